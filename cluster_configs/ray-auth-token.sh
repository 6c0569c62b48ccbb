#!/usr/bin/env bash
# Put the cluster's Ray auth token where Ray reads it (~/.ray/auth_token, mode 0600), from
# AWS Secrets Manager. Run on every node before `ray start` (cluster_configs/aws-gpu.yaml):
# with RAY_AUTH_MODE=token, every Ray process (GCS, raylets, the dashboard's Jobs API,
# drivers) then refuses a request without this token.
#
# Once per cluster, from an admin machine (any long random string will do):
#   aws secretsmanager create-secret --name elastic-train/ray-auth-token \
#     --secret-string "$(python3 -c 'import secrets; print(secrets.token_hex(32))')"
# The instance profiles of the head and the workers need secretsmanager:GetSecretValue on it.
#
# Environment: RAY_AUTH_SECRET_ID (default elastic-train/ray-auth-token), AWS_REGION
# (default: the instance's region from its metadata).
set -euo pipefail
SECRET_ID=${RAY_AUTH_SECRET_ID:-elastic-train/ray-auth-token}
if [ -z "${AWS_REGION:-}" ]; then
  IMDS=$(curl -sf -X PUT "http://169.254.169.254/latest/api/token" -H "X-aws-ec2-metadata-token-ttl-seconds: 300")
  AWS_REGION=$(curl -sf -H "X-aws-ec2-metadata-token: ${IMDS}" \
    "http://169.254.169.254/latest/meta-data/placement/region")
fi
umask 077
mkdir -p "${HOME}/.ray"
TOKEN=$(aws secretsmanager get-secret-value --region "${AWS_REGION}" --secret-id "${SECRET_ID}" \
  --query SecretString --output text)
if [ -z "${TOKEN}" ] || [ "${TOKEN}" = "None" ]; then
  echo "ray-auth-token.sh: secret ${SECRET_ID} is empty or unreadable" >&2
  exit 1
fi
printf '%s' "${TOKEN}" > "${HOME}/.ray/auth_token.tmp"
mv "${HOME}/.ray/auth_token.tmp" "${HOME}/.ray/auth_token"
echo "ray auth token installed in ${HOME}/.ray/auth_token"

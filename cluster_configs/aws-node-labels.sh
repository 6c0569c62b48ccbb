#!/usr/bin/env bash
# Print the Ray node labels that elastic/placement/topology.py reads, as `ray start --labels` wants
# them: "rack=<network node>,nvlink_domain=<instance id>".
#
# rack: the EC2 network node the instance attaches to (the last of the three layers that
#   `aws ec2 describe-instance-topology` returns; instances under the same one share a
#   switch). Needs the ec2:DescribeInstanceTopology permission in the instance profile and
#   an instance type that supports it (p4d, p5, trn1, ...). Falls back to the zone.
# nvlink_domain: on p4d/p5 the NVLink domain is one instance, so its id. (On a multi-node
#   NVLink system, e.g. a GB200 UltraServer, print the UltraServer id instead: the planner
#   then lets a TP group span the nodes that share it.)
set -u
meta() {
  curl -sf -H "X-aws-ec2-metadata-token: ${TOKEN}" "http://169.254.169.254/latest/meta-data/$1"
}
TOKEN=$(curl -sf -X PUT "http://169.254.169.254/latest/api/token" \
  -H "X-aws-ec2-metadata-token-ttl-seconds: 300")
INSTANCE_ID=$(meta instance-id)
REGION=$(meta placement/region)
ZONE=$(meta placement/availability-zone)
RACK=$(aws ec2 describe-instance-topology --region "${REGION}" --instance-ids "${INSTANCE_ID}" \
  --query 'Instances[0].NetworkNodes[-1]' --output text 2>/dev/null || true)
if [ -z "${RACK}" ] || [ "${RACK}" = "None" ]; then
  RACK="${ZONE}"
fi
echo "rack=${RACK},nvlink_domain=${INSTANCE_ID}"

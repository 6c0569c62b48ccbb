"""Cluster configs: valid for the tools that read them, and labelled the way the planner reads.

The AWS launcher YAML is checked against Ray's own cluster-config JSON schema (shipped in
``ray/autoscaler/ray-schema.json``) and Ray's validator; the KubeRay manifest is checked for
the structure the operator needs. No cloud and no cluster is touched.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from elastic.placement.planner import plan_layout
from elastic.placement.topology import topology_from_ray

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "cluster_configs"


def _load(name: str) -> dict:
    return yaml.safe_load((CONFIGS / name).read_text())


def _ray_node(i: int, labels: dict[str, str], gpus: float = 8.0) -> dict:
    return {
        "NodeID": f"{i:056x}",
        "Alive": True,
        "NodeName": f"10.0.0.{i}",
        "NodeManagerAddress": f"10.0.0.{i}",
        "Resources": {"CPU": 180.0, "GPU": gpus},
        "Labels": labels,
    }


# ---------------------------------------------------------------------- AWS launcher


def test_aws_yaml_matches_rays_schema():
    jsonschema = pytest.importorskip("jsonschema")
    import ray

    schema_path = Path(ray.__file__).parent / "autoscaler" / "ray-schema.json"
    schema = json.loads(schema_path.read_text())
    jsonschema.validate(_load("aws-gpu.yaml"), schema)


def test_aws_yaml_passes_rays_validator():
    pytest.importorskip("jsonschema")
    from ray.autoscaler._private.util import prepare_config, validate_config

    validate_config(prepare_config(_load("aws-gpu.yaml")))


def test_aws_yaml_gpu_workers_and_labels():
    cfg = _load("aws-gpu.yaml")
    assert cfg["provider"]["type"] == "aws"
    types = cfg["available_node_types"]
    assert cfg["head_node_type"] in types
    workers = [t for name, t in types.items() if name != cfg["head_node_type"]]
    assert any(t["resources"].get("GPU") == 8 for t in workers)
    start = " ".join(cfg["worker_start_ray_commands"])
    assert "--labels=" in start and "aws-node-labels.sh" in start
    assert (CONFIGS / "aws-node-labels.sh").exists()


def _fake_bin(tmp_path: Path, name: str, body: str) -> None:
    path = tmp_path / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


FAKE_CURL = """
for a in "$@"; do case "$a" in http*) url="$a" ;; esac; done
case "$url" in
  */api/token) echo tok ;;
  */instance-id) echo i-0abc123 ;;
  */placement/region) echo us-east-1 ;;
  */placement/availability-zone) echo us-east-1a ;;
  *) exit 22 ;;
esac
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize(
    "aws_body, rack",
    [("echo nn-3f2e1d", "nn-3f2e1d"), ("exit 255", "us-east-1a"), ("echo None", "us-east-1a")],
)
def test_aws_label_script_output_is_what_the_planner_reads(tmp_path, aws_body, rack):
    _fake_bin(tmp_path, "curl", FAKE_CURL)
    _fake_bin(tmp_path, "aws", aws_body + "\n")
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    out = subprocess.run(
        ["bash", str(CONFIGS / "aws-node-labels.sh")], env=env, capture_output=True, text=True, timeout=30, check=True
    ).stdout.strip()
    assert out == f"rack={rack},nvlink_domain=i-0abc123"

    from ray._private.label_utils import parse_node_labels_string, validate_node_label_syntax

    labels = parse_node_labels_string(out)  # what `ray start --labels` does with it
    validate_node_label_syntax(labels)
    node = topology_from_ray([_ray_node(1, labels)]).nodes[0]
    assert (node.rack, node.nvlink_domain) == (rack, "i-0abc123")


# ---------------------------------------------------------------------- KubeRay


def _containers(group: dict) -> list[dict]:
    return group["template"]["spec"]["containers"]


def test_kuberay_manifest_structure():
    import ray

    doc = _load("kuberay-raycluster.yaml")
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayCluster"
    assert doc["metadata"]["name"]
    spec = doc["spec"]
    assert spec["rayVersion"] == ray.__version__
    head = spec["headGroupSpec"]
    assert _containers(head)[0]["image"]
    assert all(isinstance(v, str) for v in head["rayStartParams"].values())
    groups = spec["workerGroupSpecs"]
    assert len({g["groupName"] for g in groups}) == len(groups)
    for g in groups:
        assert g["minReplicas"] <= g["replicas"] <= g["maxReplicas"]
        assert all(isinstance(v, str) for v in g["rayStartParams"].values())
        # KubeRay >= 1.5 refuses labels in rayStartParams next to the top-level field.
        assert "labels" not in g["rayStartParams"]
        container = _containers(g)[0]
        assert container["image"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
        # The group's rack label matches the Kubernetes nodes it is pinned to.
        assert g["template"]["spec"]["nodeSelector"]["topology.example.com/rack"] == g["labels"]["rack"]


def test_kuberay_labels_are_valid_ray_labels_and_plan_by_rack():
    from ray._private.label_utils import validate_node_label_syntax

    groups = _load("kuberay-raycluster.yaml")["spec"]["workerGroupSpecs"]
    nodes = []
    for g in groups:
        validate_node_label_syntax(g["labels"])
        for _ in range(g["replicas"]):
            nodes.append(_ray_node(len(nodes), dict(g["labels"])))
    assert len({g["labels"]["rack"] for g in groups}) == len(groups) >= 2
    topo = topology_from_ray(nodes)
    plan = plan_layout(topo, tp=8, pp=2, min_dp=1, max_dp=64)
    assert plan.dp == len(nodes) // 2
    assert plan.cross_rack_dp_ranks == [] and plan.ring_rack_crossings() == 2


# ---------------------------------------------------------------------- local recipe


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_local_recipe_is_valid_bash_with_labels():
    script = CONFIGS / "local.sh"
    subprocess.run(["bash", "-n", str(script)], check=True, timeout=30)
    text = script.read_text()
    assert "--labels=" in text and "rack=" in text and "--num-cpus=1" in text
    bad = subprocess.run(["bash", str(script), "bogus"], capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "usage" in bad.stderr


# ---------------------------------------------------------------------- security: Ray token auth


def _ray_starts(commands: list[str]) -> list[str]:
    return [c for c in commands if "ray start" in c]


def test_aws_turns_token_auth_on_with_a_token_from_a_secret():
    cfg = _load("aws-gpu.yaml")
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        commands = cfg[key]
        starts = _ray_starts(commands)
        assert starts and all("RAY_AUTH_MODE=token ray start" in c for c in starts), commands
        # the token is installed from the secret before Ray starts
        fetch = [i for i, c in enumerate(commands) if "ray-auth-token.sh" in c]
        assert fetch and fetch[0] < commands.index(starts[0]), commands
    head = " ".join(cfg["head_start_ray_commands"])
    assert "--dashboard-host=0.0.0.0" not in head and "--dashboard-host=127.0.0.1" in head
    assert any("export RAY_AUTH_MODE=token" in c for c in cfg["setup_commands"])  # drivers and `ray exec` too
    assert cfg["provider"]["security_group"]["GroupName"]
    assert not cfg["provider"]["security_group"].get("IpPermissions")  # no Ray port opened to anyone


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_aws_token_script_installs_the_secret_privately(tmp_path):
    """cluster_configs/ray-auth-token.sh with a fake `aws` and metadata server: the secret ends
    up in ~/.ray/auth_token, readable by its owner only; an empty secret fails the node's start."""
    bin_dir, home = tmp_path / "bin", tmp_path / "home"
    bin_dir.mkdir()
    home.mkdir()
    _fake_bin(bin_dir, "curl", FAKE_CURL)
    _fake_bin(bin_dir, "aws", 'case "$*" in *elastic-train/ray-auth-token*) echo s3cr3t-token ;; *) exit 3 ;; esac\n')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(home)}
    env.pop("AWS_REGION", None)
    script = str(CONFIGS / "ray-auth-token.sh")
    subprocess.run(["bash", script], env=env, capture_output=True, text=True, timeout=30, check=True)
    token = home / ".ray" / "auth_token"
    assert token.read_text() == "s3cr3t-token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    failed = subprocess.run(
        ["bash", script], env={**env, "RAY_AUTH_SECRET_ID": "other"}, capture_output=True, text=True, timeout=30
    )
    assert failed.returncode != 0 and token.read_text() == "s3cr3t-token"


def test_kuberay_turns_token_auth_on_with_a_secret_and_admits_only_its_pods():
    doc = _load("kuberay-raycluster.yaml")
    auth = doc["spec"]["authOptions"]
    assert auth["mode"] == "token" and auth["secretName"]
    assert doc["spec"]["headGroupSpec"]["serviceType"] == "ClusterIP"
    policy = _load("kuberay-networkpolicy.yaml")
    assert policy["kind"] == "NetworkPolicy" and policy["spec"]["policyTypes"] == ["Ingress"]
    own = {"ray.io/cluster": doc["metadata"]["name"]}
    assert policy["spec"]["podSelector"]["matchLabels"] == own
    sources = [src for rule in policy["spec"]["ingress"] for src in rule["from"]]
    assert {"podSelector": {"matchLabels": own}} in sources
    assert all("ipBlock" not in src for src in sources)  # nothing from outside the Kubernetes cluster


def test_local_recipe_uses_token_auth():
    text = (CONFIGS / "local.sh").read_text()
    assert "RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}" in text and "--dashboard-host=127.0.0.1" in text


@pytest.mark.skipif(shutil.which("bash") is None or not os.path.isdir("/proc"), reason="needs bash and /proc")
def test_local_down_stops_only_the_cluster_up_recorded(tmp_path):
    """`local.sh down` signals the processes naming the recorded cluster's temp dir and no
    other (stand-ins for two clusters' processes: no Ray needed), forgets the cluster, and
    with none recorded stops nothing and exits 2. It never runs `ray stop`."""
    ours_dir, theirs_dir = tmp_path / "ray-local-ours", tmp_path / "ray-local-theirs"
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    ours = subprocess.Popen([*sleeper, f"--temp-dir={ours_dir}"])
    theirs = subprocess.Popen([*sleeper, f"--temp-dir={theirs_dir}"])
    state = tmp_path / "cluster.env"
    state.write_text(f"PORT=1\nDASHBOARD_PORT=2\nCLIENT_PORT=3\nTEMP_DIR={ours_dir}\nPIDS='{ours.pid}'\n")
    env = {**os.environ, "STATE": str(state), "RAY": "false"}  # a `ray` call would fail the script
    cmd = ["bash", str(CONFIGS / "local.sh"), "down"]
    try:
        down = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        assert down.returncode == 0, down.stderr
        assert ours.wait(timeout=30) is not None and theirs.poll() is None
        assert not state.exists()
        again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        assert again.returncode == 2 and "no cluster recorded" in again.stderr and theirs.poll() is None
    finally:
        for p in (ours, theirs):
            p.kill()
            p.wait(timeout=30)
    assert "ray stop" not in (CONFIGS / "local.sh").read_text().split("set -euo pipefail")[1]

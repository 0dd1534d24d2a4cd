"""Every cloud call a launcher file makes as its nodes come up, and the permission each one needs: the
host's initialization commands, the containers' setup and `ray start` commands (the secrets
`vitsweep-secret` reads), the image Ray pulls, the GPU workers the head's autoscaler launches and the
dataset a job's driver verifies on the head. Each call's permission comes from the table below, which
cites the provider's documentation; the CLIs are never run. Each node's identity is the one its file
names (AWS: an instance profile; GCP: a service account, the head's being Ray's own), and the README's
setup creates it, with every grant, before the first `ray up` starts a node that uses it."""
from __future__ import annotations

import ast
import fnmatch
import importlib.util
import itertools
import json
import re
import runpy
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
CLUSTER = ROOT / "cluster"
README = (ROOT / "README.md").read_text()


def ray_gcp_launcher_constants() -> dict:
    """The module-level constants of Ray's GCP launcher (``ray/autoscaler/_private/gcp/config.py``), evaluated
    from its source in order (``RAY + "-sa-" + VERSION``): importing it needs Google's client libraries,
    which only a launcher's machine has."""
    source = Path(importlib.util.find_spec("ray").origin).parent / "autoscaler" / "_private" / "gcp" / "config.py"
    constants: dict = {}
    for node in ast.parse(source.read_text()).body:
        names = [getattr(target, "id", None) for target in getattr(node, "targets", [])]
        if isinstance(node, ast.Assign) and names and all(n and n.isupper() for n in names):
            try:
                value = eval(compile(ast.Expression(node.value), str(source), "eval"), {"__builtins__": {}}, constants)
            except Exception:  # noqa: BLE001 (a constant built from what is not a constant: not needed here)
                continue
            constants.update(dict.fromkeys(names, value))
    return constants


RAY_GCP = ray_gcp_launcher_constants()
DEFAULT_SERVICE_ACCOUNT_ID = RAY_GCP["DEFAULT_SERVICE_ACCOUNT_ID"]  # the head's account
DEFAULT_SERVICE_ACCOUNT_ROLES = RAY_GCP["DEFAULT_SERVICE_ACCOUNT_ROLES"]  # granted to it at `ray up`


@dataclass(frozen=True)
class Call:
    """A cloud call: the text that makes it in a node's commands (None: Ray makes it), the permissions
    it needs, and where the provider says so."""

    what: str
    pattern: str | None
    permissions: tuple[str, ...]
    source: str


AWS_CALLS = [
    Call("EFS file system found by name", r"\baws efs describe-file-systems\b", ("elasticfilesystem:DescribeFileSystems",),
         "https://docs.aws.amazon.com/efs/latest/ug/API_DescribeFileSystems.html"),
    Call("a secret read (boto3 get_secret_value)", r"\bvitsweep-secret aws\b", ("secretsmanager:GetSecretValue",),
         "https://docs.aws.amazon.com/secretsmanager/latest/apireference/API_GetSecretValue.html"),
    Call("the MLflow server's secrets (vitsweep-mlflow-server reads them with vitsweep-secret)",
         r"\bvitsweep-mlflow-server aws\b", ("secretsmanager:GetSecretValue",),
         "https://docs.aws.amazon.com/secretsmanager/latest/apireference/API_GetSecretValue.html"),
    Call("the registry's login token", r"\baws ecr get-login-password\b", ("ecr:GetAuthorizationToken",),
         "https://docs.aws.amazon.com/AmazonECR/latest/APIReference/API_GetAuthorizationToken.html"),
    Call("the account id (no permission needed)", r"\baws sts get-caller-identity\b", (),
         "https://docs.aws.amazon.com/STS/latest/APIReference/API_GetCallerIdentity.html"),
]
AWS_IMAGE_PULL = Call("the image pulled from ECR", None, ("ecr:BatchGetImage", "ecr:GetDownloadUrlForLayer"),
                      "https://docs.aws.amazon.com/AmazonECR/latest/userguide/image-push-iam.html")
AWS_AUTOSCALER = Call("the GPU workers launched and ended (Ray's AWS node provider)", None,
                      ("ec2:RunInstances", "ec2:CreateTags", "ec2:DescribeInstances", "ec2:TerminateInstances"),
                      "https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_RunInstances.html")
AWS_PASS_ROLE = Call("the GPU workers' role given to them", None, ("iam:PassRole",),
                     "https://docs.aws.amazon.com/IAM/latest/UserGuide/id_roles_use_switch-role-ec2.html")
AWS_SSM_AMI = Call("the workers' resolve:ssm image id", None, ("ssm:GetParameters",),
                   "https://docs.aws.amazon.com/AWSEC2/latest/UserGuide/finding-an-ami-parameter-store.html")
AWS_DATASET = Call("the dataset verified by a job's driver", None, ("s3:GetObject", "s3:ListBucket"),
                   "https://docs.aws.amazon.com/AmazonS3/latest/API/API_GetObject.html")
# AWS managed policies the README attaches, by the actions they allow.
MANAGED_POLICIES = {  # https://docs.aws.amazon.com/aws-managed-policy/latest/reference/AmazonEC2FullAccess.html
    "arn:aws:iam::aws:policy/AmazonEC2FullAccess": ("ec2:*", "elasticloadbalancing:*", "cloudwatch:*", "autoscaling:*"),
}

GCP_CALLS = [
    Call("Filestore instance found by name", r"\bgcloud filestore instances describe\b", ("file.instances.get",),
         "https://cloud.google.com/filestore/docs/access-control"),
    Call("a secret read (Secret Manager's REST API)", r"\bvitsweep-secret gcp\b", ("secretmanager.versions.access",),
         "https://cloud.google.com/secret-manager/docs/access-control"),
    Call("the MLflow server's secrets (vitsweep-mlflow-server reads them with vitsweep-secret)",
         r"\bvitsweep-mlflow-server gcp\b", ("secretmanager.versions.access",),
         "https://cloud.google.com/secret-manager/docs/access-control"),
    Call("Docker's credential helper set up (no permission needed)", r"\bgcloud auth configure-docker\b", (),
         "https://cloud.google.com/artifact-registry/docs/docker/authentication"),
]
GCP_IMAGE_PULL = Call("the image pulled from Artifact Registry", None, ("artifactregistry.repositories.downloadArtifacts",),
                      "https://cloud.google.com/artifact-registry/docs/access-control")
GCP_AUTOSCALER = Call("the GPU workers launched and ended, with their account (Ray's GCP node provider)", None,
                      ("compute.instances.create", "compute.instances.delete", "iam.serviceAccounts.actAs"),
                      "https://cloud.google.com/compute/docs/access/iam")
GCP_DATASET = Call("the dataset verified by a job's driver", None, ("storage.objects.get", "storage.objects.list"),
                   "https://cloud.google.com/storage/docs/access-control/iam-permissions")
# The permissions each role the README or Ray grants holds, of those the calls above need.
# https://cloud.google.com/iam/docs/understanding-roles
ROLE_PERMISSIONS = {
    "roles/secretmanager.secretAccessor": {"secretmanager.versions.access"},
    "roles/file.viewer": {"file.instances.get", "file.instances.list"},
    "roles/artifactregistry.reader": {"artifactregistry.repositories.downloadArtifacts"},
    "roles/storage.objectViewer": {"storage.objects.get", "storage.objects.list"},
    "roles/storage.objectAdmin": {"storage.objects.get", "storage.objects.list", "storage.objects.create"},
    "roles/compute.admin": {"compute.instances.create", "compute.instances.delete"},
    "roles/iam.serviceAccountUser": {"iam.serviceAccounts.actAs"},
    "roles/iam.roleViewer": set(),
}


def launcher(name: str) -> dict:
    return yaml.safe_load((CLUSTER / name).read_text())


def node_config(config: dict, head: bool) -> dict:
    (node,) = [node for name, node in config["available_node_types"].items() if (name == config["head_node_type"]) == head]
    return node["node_config"]


def commands_of(config: dict, head: bool) -> list[str]:
    """What runs with the node's identity: the host's initialization commands, then the container's."""
    own = ("head_setup_commands", "head_start_ray_commands") if head else ("worker_setup_commands",
                                                                          "worker_start_ray_commands")
    return [*config["initialization_commands"], *config["setup_commands"], *(c for key in own for c in config[key])]


def calls_of(config: dict, head: bool, table: list[Call], image_pull: Call, launches: list[Call],
             dataset: Call) -> list[Call]:
    """Every cloud call the node makes as it comes up (and, the head, as it runs jobs)."""
    text = "\n".join(commands_of(config, head))
    found = [call for call in table if re.search(call.pattern, text)]
    for invocation in re.finditer(r"(?<!vitsweep-secret )\b(aws|gcloud) [\w-]+", text):
        rest = text[invocation.start():]
        assert any(re.match(call.pattern, rest) for call in table), f"a cloud call with no row here: {rest[:70]!r}"
    if config["docker"].get("pull_before_run"):
        found.append(image_pull)
    return found + (launches + [dataset] if head else [])


def aws_launches(config: dict) -> list[Call]:
    worker = node_config(config, head=False)
    return [AWS_AUTOSCALER, *([AWS_PASS_ROLE] if "IamInstanceProfile" in worker else []),
            *([AWS_SSM_AMI] if str(worker["ImageId"]).startswith("resolve:ssm:") else [])]


def readme_lines() -> list[str]:
    """The README's shell lines, continuation lines joined, in order."""
    return [line.strip() for line in README.replace("\\\n", " ").splitlines()]


def line_index(pattern: str) -> int:
    found = [i for i, line in enumerate(readme_lines()) if re.search(pattern, line)]
    assert found, f"the README has no line matching {pattern!r}"
    return found[0]


def first_ray_up(name: str) -> int:
    """The README line of the first `ray up` that starts ``name``'s nodes (its "or" names the other file)."""
    return line_index(rf"^ray up cluster/\S+\.yaml .*\b{re.escape(name)}\b|^ray up cluster/{re.escape(name)}\b")


def aws_role_actions(profile: str) -> tuple[str, list[str], int]:
    """(role, the actions its README policies allow, the README line that last touches it) of an instance profile."""
    lines = readme_lines()
    (role,) = {m.group(1) for line in lines if (m := re.search(
        rf"aws iam add-role-to-instance-profile --instance-profile-name {profile} --role-name (\S+)", line))}
    created = line_index(rf"aws iam create-instance-profile --instance-profile-name {profile}\b")
    actions, last = [], created
    for i, line in enumerate(lines):
        if not re.match(rf"aws iam (put-role-policy|attach-role-policy) --role-name {role}\b", line):
            continue
        last = max(last, i)
        if arn := re.search(r"--policy-arn (\S+)", line):
            actions += MANAGED_POLICIES[arn.group(1)]
        else:
            path = re.search(r"(cluster/iam/[\w.-]+\.json)", line).group(1)
            actions += [action for statement in json.loads((ROOT / path).read_text())["Statement"]
                        if statement["Effect"] == "Allow" for action in statement["Action"]]
    return role, actions, last


def gcp_account_roles(variable: str, email_prefix: str) -> tuple[set[str], int]:
    """(the roles the README grants the account in ``$variable``, the README line of the last grant)."""
    lines = readme_lines()
    created = line_index(rf"gcloud iam service-accounts create {email_prefix}\b.*\b{variable}={email_prefix}@")
    grants = [(i, re.search(r"--role=([\w./]+)", line).group(1)) for i, line in enumerate(lines)
              if f"--member=serviceAccount:${variable} " in line]
    return {role for _, role in grants}, max([created, *(i for i, _ in grants)])


@pytest.mark.parametrize("head", [True, False], ids=["head", "GPU worker"])
def test_every_aws_call_a_node_makes_is_granted_to_its_role_created_before_the_first_ray_up(head):
    config = launcher("aws-p4d.yaml")
    profile = node_config(config, head)["IamInstanceProfile"]["Name"]
    role, actions, last = aws_role_actions(profile)
    calls = calls_of(config, head, AWS_CALLS, AWS_IMAGE_PULL, aws_launches(config), AWS_DATASET)
    assert calls, "the node makes no cloud call"
    missing = [(call.what, permission, call.source) for call in calls for permission in call.permissions
               if not any(fnmatch.fnmatchcase(permission, action) for action in actions)]
    assert not missing, f"role {role} (instance profile {profile}) lacks: {missing}"
    assert last < first_ray_up("aws-p4d.yaml")


def test_the_aws_head_passes_only_the_gpu_workers_role():
    config = launcher("aws-p4d.yaml")
    worker_profile = node_config(config, head=False)["IamInstanceProfile"]["Name"]
    worker_role, _, _ = aws_role_actions(worker_profile)
    policy = re.search(r"(cluster/iam/[\w.-]+\.json)", next(line for line in readme_lines() if re.match(
        rf"aws iam put-role-policy --role-name {aws_role_actions('vitsweep-head')[0]}\b", line))).group(1)
    (passing,) = [s for s in json.loads((ROOT / policy).read_text())["Statement"] if "iam:PassRole" in s["Action"]]
    assert passing["Resource"] == f"arn:aws:iam::*:role/{worker_role}"


@pytest.mark.parametrize("head", [True, False], ids=["head", "GPU worker"])
def test_every_gcp_call_a_node_makes_is_granted_to_its_account_created_before_the_first_ray_up(head):
    config = launcher("gcp-a2.yaml")
    if head:  # Ray's GCP launcher gives the head its own account, and its autoscaler roles, at `ray up`
        assert "serviceAccounts" not in node_config(config, head)
        roles, last = gcp_account_roles("HEAD_SA", DEFAULT_SERVICE_ACCOUNT_ID)
        roles |= set(DEFAULT_SERVICE_ACCOUNT_ROLES)
    else:
        (account,) = node_config(config, head)["serviceAccounts"]
        roles, last = gcp_account_roles("SA", account["email"].split("@")[0])
    launches = [GCP_AUTOSCALER]
    calls = calls_of(config, head, GCP_CALLS, GCP_IMAGE_PULL, launches, GCP_DATASET)
    held = set().union(*(ROLE_PERMISSIONS[role] for role in roles))
    missing = [(call.what, permission, call.source) for call in calls for permission in call.permissions
               if permission not in held]
    assert not missing, f"roles {sorted(roles)} lack: {missing}"
    assert last < first_ray_up("gcp-a2.yaml")


@pytest.mark.parametrize("name,login", [("aws-p4d.yaml", r"docker login .*--password-stdin"),
                                        ("gcp-a2.yaml", r"gcloud auth configure-docker us-central1-docker\.pkg\.dev")])
def test_a_launcher_logs_docker_in_to_its_registry_before_it_pulls_the_private_image(name, login):
    config = launcher(name)
    assert config["docker"]["pull_before_run"]
    # initialization_commands run on the host before Ray's `docker pull`, as the ssh user that pulls
    assert any(re.search(login, command) for command in config["initialization_commands"])
    assert not any(re.search(r"\bsudo\b[^|&;]*\bdocker login\b", c) for c in config["initialization_commands"])
    for command in config["initialization_commands"]:
        shlex.split(command)  # each parses as shell words


# The secrets a node's commands read: `vitsweep-secret PLATFORM NAME`, and those the head's MLflow server reads.
SECRET_READ = re.compile(r"\bvitsweep-secret (?:aws|gcp) ([\w-]+)")
MLFLOW_SERVER_SECRETS = set(runpy.run_path(str(CLUSTER / "bin" / "vitsweep-mlflow-server"))["SECRETS"].values())


def secrets_read(config: dict, head: bool) -> set[str]:
    text = "\n".join(commands_of(config, head))
    return {*SECRET_READ.findall(text), *(MLFLOW_SERVER_SECRETS if "vitsweep-mlflow-server " in text else ())}


def aws_secrets_granted(profile: str) -> set[str]:
    """The secrets the README's policies let the instance profile's role read (their ARNs' names)."""
    role, _, _ = aws_role_actions(profile)
    granted = set()
    for line in readme_lines():
        if re.match(rf"aws iam put-role-policy --role-name {role}\b", line):
            policy = json.loads((ROOT / re.search(r"(cluster/iam/[\w.-]+\.json)", line).group(1)).read_text())
            granted |= {re.search(r":secret:([\w-]+)-\*$", arn).group(1) for statement in policy["Statement"]
                        if "secretsmanager:GetSecretValue" in statement["Action"] for arn in statement["Resource"]}
    return granted


def gcp_secrets_granted(variable: str) -> set[str]:
    """The secrets the README binds to the account in ``$variable`` (its `for s in ...` loops)."""
    return {name for line in readme_lines() if f"--member=serviceAccount:${variable} " in line
            and (loop := re.match(r"for s in ([\w -]+); do gcloud secrets add-iam-policy-binding \$s ", line))
            for name in loop.group(1).split()}


@pytest.mark.parametrize("head", [True, False], ids=["head", "GPU worker"])
def test_each_launcher_node_may_read_exactly_the_secrets_it_reads_each_created_before_the_first_ray_up(head):
    """Least privilege per secret, not per action: the GPU workers read Ray's token and MLflow's training
    password, never the MLflow admin's (the head's server alone reads it)."""
    aws, gcp = launcher("aws-p4d.yaml"), launcher("gcp-a2.yaml")
    read = secrets_read(aws, head)
    assert read == secrets_read(gcp, head)
    assert ("vitsweep-mlflow-admin-password" in read) == head
    assert aws_secrets_granted(node_config(aws, head)["IamInstanceProfile"]["Name"]) == read
    assert gcp_secrets_granted("HEAD_SA" if head else "SA") == read
    creates = {"aws-p4d.yaml": r"^aws secretsmanager create-secret --name {} ", "gcp-a2.yaml": r"gcloud secrets create {} "}
    for (launcher_file, create), name in itertools.product(creates.items(), read):
        assert line_index(create.format(name)) < first_ray_up(launcher_file), (name, launcher_file)

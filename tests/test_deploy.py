"""The Kubernetes manifests under deploy/ (issue 32): every object validates against the
Kubernetes schemas (kubernetes-validate, which bundles them: no cluster, no network), the
gateway and worker probes are wired to /livez (liveness) and /readyz (readiness) on ports the
containers declare, the Services select the pods they front, and every STREAMSERVER_* variable
a container sets is one its command reads."""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from streamserver.cli import build_parser
from streamserver.cli_env import OWN, env_name

DEPLOY = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
VERSION = kubernetes_validate.latest_version()


def _objects() -> list[dict]:
    return [doc for path in sorted(DEPLOY.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]


def _by(kind: str, name: str) -> dict:
    return next(o for o in _objects() if o["kind"] == kind and o["metadata"]["name"] == name)


def _container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def test_every_manifest_validates_against_the_kubernetes_schemas():
    objects = _objects()
    assert {(o["kind"], o["metadata"]["name"]) for o in objects} >= {
        ("Deployment", "streamserver-gateway"), ("Service", "streamserver-gateway"),
        ("Deployment", "streamserver-worker"), ("Deployment", "redis"), ("Service", "redis")}
    for o in objects:
        kubernetes_validate.validate(o, VERSION, strict=True)  # raises ValidationError, naming the field
    # The validator does check: a probe whose port is a list, or a field Kubernetes has not, fails.
    broken = copy.deepcopy(_by("Deployment", "streamserver-gateway"))
    _container(broken)["livenessProbe"]["httpGet"]["port"] = ["http"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSION, strict=True)
    unknown = copy.deepcopy(_by("Deployment", "streamserver-worker"))
    _container(unknown)["readinessProbe"]["httpGet"]["pathh"] = "/readyz"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(unknown, VERSION, strict=True)


@pytest.mark.parametrize("name", ["streamserver-gateway", "streamserver-worker"])
def test_probes_use_livez_for_liveness_and_readyz_for_readiness(name):
    container = _container(_by("Deployment", name))
    ports = {p["name"] for p in container["ports"]}
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert container["startupProbe"]["httpGet"]["path"] == "/livez"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["port"] in ports  # a port the container declares
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]


def test_services_select_their_pods_and_target_declared_ports():
    for service in (o for o in _objects() if o["kind"] == "Service"):
        deployment = _by("Deployment", service["metadata"]["name"])
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        declared = {p["name"] for p in _container(deployment)["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= declared


def test_every_variable_a_container_sets_is_read_by_its_command():
    parser = build_parser()
    commands = next(a for a in parser._actions if a.dest == "command").choices  # argparse keeps no public list
    for name in ("streamserver-gateway", "streamserver-worker"):
        container = _container(_by("Deployment", name))
        command = container["args"][0]
        known = {env_name(a) for p in (parser, commands[command]) for a in p._actions if a.option_strings} | set(OWN)
        given = {e["name"] for e in container["env"] if e["name"].startswith("STREAMSERVER_")}
        assert given and given <= known, given - known
        if command == "gateway":  # its required settings, and the secret it requires with Redis
            assert {"STREAMSERVER_REDIS_URL", "STREAMSERVER_SECRET"} <= given

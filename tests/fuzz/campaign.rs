//! How a fuzz test runs its cases: the configuration read from the environment (seed, case
//! count, one case alone, KEEP_GOING, VERBOSE), the failures and the final report, and the
//! process-wide record of panics.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::ops::Range;
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use rand::SeedableRng;
use rand::rngs::StdRng;

/// Cases per test when `GPU_FLIGHT_FUZZ_CASES` is unset: about 10 s of DoPut cases and 3 s of
/// unary ones in a debug build on two cores.
const DEFAULT_CASES: u64 = 300;

#[derive(Debug, Clone)]
pub(crate) struct Config {
    seed: u64,
    cases: u64,
    pub(crate) only: Option<u64>,
    pub(crate) keep_going: bool,
    verbose: bool,
}

impl Config {
    pub(crate) fn from_env(test: &str) -> Self {
        let seed = env_u64("GPU_FLIGHT_FUZZ_SEED").unwrap_or_else(|| {
            let now = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .expect("clock after 1970");
            now.as_nanos() as u64
        });
        let config = Self {
            seed,
            cases: env_u64("GPU_FLIGHT_FUZZ_CASES").unwrap_or(DEFAULT_CASES),
            only: env_u64("GPU_FLIGHT_FUZZ_CASE"),
            keep_going: env_flag("GPU_FLIGHT_FUZZ_KEEP_GOING"),
            verbose: env_flag("GPU_FLIGHT_FUZZ_VERBOSE"),
        };
        announce(&format!(
            "fuzz {test}: seed {seed}, {} cases{}; replay with GPU_FLIGHT_FUZZ_SEED={seed} \
             GPU_FLIGHT_FUZZ_CASES={} cargo test --test fuzz {test} -- --nocapture",
            config.cases,
            config
                .only
                .map(|i| format!(" (only case {i})"))
                .unwrap_or_default(),
            config.cases,
        ));
        config
    }

    pub(crate) fn indices(&self) -> Range<u64> {
        match self.only {
            Some(index) => index..index + 1,
            None => 0..self.cases,
        }
    }

    /// Each case has its own generator so that one case replays without the others.
    pub(crate) fn rng(&self, index: u64) -> StdRng {
        StdRng::seed_from_u64(self.seed ^ index.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }
}

/// Whether one case alone is replayed (`GPU_FLIGHT_FUZZ_CASE`): the corpus is then not put
/// unmutated first.
pub(crate) fn one_case_only() -> bool {
    env_u64("GPU_FLIGHT_FUZZ_CASE").is_some()
}

fn env_u64(name: &str) -> Option<u64> {
    let value = std::env::var(name).ok()?;
    Some(
        value
            .trim()
            .parse()
            .unwrap_or_else(|e| panic!("{name}={value:?} is not a u64: {e}")),
    )
}

fn env_flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| !v.is_empty() && v != "0")
}

/// Prints to the captured test output (shown with a failure) and to stderr uncaptured (see
/// [`progress`]); with `--nocapture` the line therefore appears twice.
fn announce(line: &str) {
    println!("{line}");
    progress(line);
}

/// Writes straight to stderr, which libtest does not capture (`eprintln!` it does): when the
/// process aborts (an allocation failure is not a panic) captured output is lost, and these
/// lines are what tell which seed and case to replay.
fn progress(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

/// One broken invariant. `fatal` stops the run even with KEEP_GOING: after a hang the server
/// cannot be trusted to answer the next case.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) class: String,
    pub(crate) detail: String,
    pub(crate) fatal: bool,
}

impl Failure {
    pub(crate) fn new(class: impl Into<String>, detail: impl Into<String>) -> Self {
        Self {
            class: class.into(),
            detail: detail.into(),
            fatal: false,
        }
    }
}

pub(crate) type Checked<T> = Result<T, Failure>;

/// A failed case as the final report shows it.
#[derive(Debug)]
pub(crate) struct Recorded {
    case: String,
    mutations: String,
    pub(crate) failure: Failure,
    panics: Vec<PanicRecord>,
}

/// Runs the cases of one test, stopping at the first failure unless KEEP_GOING.
#[derive(Debug)]
pub(crate) struct Campaign {
    pub(crate) config: Config,
    pub(crate) failures: Vec<Recorded>,
    ran: u64,
    /// How often each call ended how, to see what the mutations reach.
    pub(crate) outcomes: BTreeMap<String, u64>,
    started: Instant,
}

impl Campaign {
    pub(crate) fn new(config: Config) -> Self {
        Self {
            config,
            failures: Vec::new(),
            ran: 0,
            outcomes: BTreeMap::new(),
            started: Instant::now(),
        }
    }

    pub(crate) fn begin(&self, case: &str, mutations: &str) {
        *lock(&CURRENT_CASE) = format!("{case} [{mutations}]");
        if self.config.verbose {
            progress(&format!("{case}: {mutations}"));
        }
    }

    /// Records the outcome of a case; returns whether to go on.
    pub(crate) fn end(
        &mut self,
        case: String,
        mutations: String,
        outcome: Checked<()>,
        panics: usize,
    ) -> bool {
        self.ran += 1;
        let new_panics = panics_since(panics);
        // A panic is the most specific account of a failure: it names the class, and what the
        // client saw (often CANCELLED, the stream reset) goes in the detail.
        let failure = match (outcome, new_panics.first()) {
            (Ok(()), None) => None,
            (Err(failure), None) => Some(failure),
            (outcome, Some(first)) => Some(Failure {
                class: format!("panic at {}", short_location(&first.location)),
                detail: match &outcome {
                    Ok(()) => "the call itself passed".to_owned(),
                    Err(f) => format!("{}: {}", f.class, f.detail),
                },
                fatal: outcome.is_err_and(|f| f.fatal),
            }),
        };
        let Some(failure) = failure else {
            return true;
        };
        let fatal = failure.fatal;
        let recorded = Recorded {
            case,
            mutations,
            failure,
            panics: new_panics,
        };
        progress(&format!(
            "FAILED {} (seed {}): {}\n  mutations: {}\n  {}{}",
            recorded.case,
            self.config.seed,
            recorded.failure.class,
            recorded.mutations,
            recorded.failure.detail,
            describe_panics(&recorded.panics),
        ));
        self.failures.push(recorded);
        self.config.keep_going && !fatal
    }

    /// Panics with a summary of the failures, grouped by class, if there were any.
    pub(crate) fn finish(self, test: &str) {
        let elapsed = self.started.elapsed();
        let outcomes: Vec<String> = self
            .outcomes
            .iter()
            .map(|(outcome, count)| format!("{outcome} {count}"))
            .collect();
        announce(&format!("fuzz {test}: outcomes: {}", outcomes.join(", ")));
        if self.failures.is_empty() {
            announce(&format!(
                "fuzz {test}: seed {}: {} cases passed in {:.1} s",
                self.config.seed,
                self.ran,
                elapsed.as_secs_f64()
            ));
            return;
        }
        let mut classes: BTreeMap<&str, Vec<&Recorded>> = BTreeMap::new();
        for failure in &self.failures {
            classes
                .entry(failure.failure.class.as_str())
                .or_default()
                .push(failure);
        }
        let mut summary = format!(
            "fuzz {test}: seed {}: {} of {} cases failed ({:.1} s), {} classes:\n",
            self.config.seed,
            self.failures.len(),
            self.ran,
            elapsed.as_secs_f64(),
            classes.len()
        );
        for (class, examples) in &classes {
            let first = examples[0];
            summary.push_str(&format!(
                "- {class}: {} case(s), first {} [{}]\n    {}{}\n",
                examples.len(),
                first.case,
                first.mutations,
                first.failure.detail,
                describe_panics(&first.panics)
            ));
        }
        summary.push_str(&format!(
            "replay with GPU_FLIGHT_FUZZ_SEED={} GPU_FLIGHT_FUZZ_CASE=<index>",
            self.config.seed
        ));
        if self.failures.iter().any(|f| f.failure.fatal) {
            // A hung handler keeps running on its thread, usually allocating as it goes; only
            // ending the process stops it before it takes the machine's memory.
            announce(&summary);
            std::process::exit(101);
        }
        panic!("{summary}");
    }
}

/// A panic location without the cargo registry prefix.
fn short_location(location: &str) -> &str {
    location
        .find("index.crates.io-")
        .and_then(|at| {
            location[at..]
                .find('/')
                .map(|slash| &location[at + slash + 1..])
        })
        .unwrap_or(location)
}

fn describe_panics(panics: &[PanicRecord]) -> String {
    panics
        .iter()
        .map(|p| {
            format!(
                "\n    panic in thread '{}' at {}: {}",
                p.thread, p.location, p.message
            )
        })
        .collect()
}

// Process-wide state: panics, the case running, one test at a time

#[derive(Debug, Clone)]
struct PanicRecord {
    thread: String,
    location: String,
    message: String,
}

static PANICS: Mutex<Vec<PanicRecord>> = Mutex::new(Vec::new());
static CURRENT_CASE: Mutex<String> = Mutex::new(String::new());
/// The two tests share the panic hook and its count, so they take turns.
pub(crate) static SERIAL: Mutex<()> = Mutex::new(());

/// A poisoned lock only means another test failed; the data is still usable.
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Records every panic (server tasks included: tokio catches them, so nothing else would
/// notice), then lets the previous hook print it as usual.
pub(crate) fn install_panic_hook() {
    static INSTALLED: OnceLock<()> = OnceLock::new();
    INSTALLED.get_or_init(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let record = PanicRecord {
                thread: std::thread::current()
                    .name()
                    .unwrap_or("unnamed")
                    .to_owned(),
                location: info
                    .location()
                    .map(|l| format!("{}:{}:{}", l.file(), l.line(), l.column()))
                    .unwrap_or_else(|| "unknown location".to_owned()),
                message: panic_message(info.payload()).chars().take(500).collect(),
            };
            lock(&PANICS).push(record);
            let case = lock(&CURRENT_CASE).clone();
            eprintln!("panic while running {case}");
            previous(info);
        }));
    });
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> &str {
    if let Some(text) = payload.downcast_ref::<&str>() {
        text
    } else if let Some(text) = payload.downcast_ref::<String>() {
        text
    } else {
        "(non-string payload)"
    }
}

pub(crate) fn panic_count() -> usize {
    lock(&PANICS).len()
}

fn panics_since(count: usize) -> Vec<PanicRecord> {
    lock(&PANICS).get(count..).unwrap_or_default().to_vec()
}

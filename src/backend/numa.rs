//! NUMA placement of host memory: which CPUs belong to a node (sysfs), and running an
//! allocation on them, so that pinned staging memory for a GPU lies on the node nearest it.
//!
//! Pages are placed on the node of the CPU that first touches them; a pinned buffer's pages are
//! touched by the thread that pins it, before they are registered (`ffi::PinnedBuffer`).
//! Pinning with the thread bound to the GPU's node's CPUs (and unbinding it after) therefore
//! places the buffer there, with no memory-policy system calls.

use std::path::Path;

use nix::sched::{CpuSet, sched_getaffinity, sched_setaffinity};
use nix::unistd::Pid;

/// The CPUs of NUMA node `node` under `sysfs` (normally `/sys`), from its `cpulist` (e.g.
/// `0-15,32-47`); `None` where it is missing or unreadable.
pub fn node_cpus(sysfs: &Path, node: u32) -> Option<Vec<usize>> {
    let path = sysfs.join(format!("devices/system/node/node{node}/cpulist"));
    parse_cpu_list(std::fs::read_to_string(path).ok()?.trim())
}

fn parse_cpu_list(list: &str) -> Option<Vec<usize>> {
    let mut cpus = Vec::new();
    for range in list.split(',').filter(|r| !r.is_empty()) {
        let (first, last): (usize, usize) = match range.split_once('-') {
            Some((first, last)) => (first.parse().ok()?, last.parse().ok()?),
            None => {
                let cpu = range.parse().ok()?;
                (cpu, cpu)
            }
        };
        if last < first || last >= CpuSet::count() {
            return None;
        }
        cpus.extend(first..=last);
    }
    (!cpus.is_empty()).then_some(cpus)
}

/// Runs `work` on this thread bound to `cpus` (those of them it may use), then restores the
/// thread's affinity. Where binding fails or no CPU of `cpus` is allowed, `work` runs unbound:
/// placement is an optimisation, never a reason to fail.
pub fn on_cpus<T>(cpus: &[usize], work: impl FnOnce() -> T) -> T {
    let this = Pid::from_raw(0);
    let Ok(allowed) = sched_getaffinity(this) else {
        return work();
    };
    let mut wanted = CpuSet::new();
    let mut any = false;
    for &cpu in cpus {
        if allowed.is_set(cpu).unwrap_or(false) && wanted.set(cpu).is_ok() {
            any = true;
        }
    }
    if !any || sched_setaffinity(this, &wanted).is_err() {
        return work();
    }
    let _restore = Restore(allowed);
    work()
}

/// Gives this thread back its CPUs when dropped, on return or unwind.
struct Restore(CpuSet);

impl Drop for Restore {
    fn drop(&mut self) {
        if let Err(error) = sched_setaffinity(Pid::from_raw(0), &self.0) {
            tracing::warn!(%error, "restoring a thread's CPU affinity failed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists_parse_as_sysfs_writes_them() {
        assert_eq!(
            parse_cpu_list("0-3,8,10-11"),
            Some(vec![0, 1, 2, 3, 8, 10, 11])
        );
        assert_eq!(parse_cpu_list("5"), Some(vec![5]));
        for bad in ["", "3-1", "a", "1-", "0-99999999"] {
            assert_eq!(parse_cpu_list(bad), None, "{bad:?}");
        }
        let sysfs = std::env::temp_dir().join(format!("gpu-flight-numa-{}", std::process::id()));
        let node = sysfs.join("devices/system/node/node1");
        std::fs::create_dir_all(&node).expect("dir");
        std::fs::write(node.join("cpulist"), "2-3\n").expect("write");
        assert_eq!(node_cpus(&sysfs, 1), Some(vec![2, 3]));
        assert_eq!(node_cpus(&sysfs, 0), None);
        std::fs::remove_dir_all(&sysfs).expect("clean up");
    }

    #[test]
    fn work_runs_bound_to_the_cpus_and_the_thread_is_unbound_after() {
        let this = Pid::from_raw(0);
        let before = sched_getaffinity(this).expect("affinity");
        let first = (0..CpuSet::count())
            .find(|&cpu| before.is_set(cpu).unwrap_or(false))
            .expect("an allowed CPU");
        let inside = on_cpus(&[first], || sched_getaffinity(this).expect("affinity"));
        let bound: Vec<usize> = (0..CpuSet::count())
            .filter(|&cpu| inside.is_set(cpu).unwrap_or(false))
            .collect();
        assert_eq!(bound, [first]);
        assert_eq!(sched_getaffinity(this).expect("affinity"), before);
        // No allowed CPU among those asked for: the work runs anyway, unbound.
        assert_eq!(on_cpus(&[CpuSet::count() + 1], || 7), 7);
    }
}

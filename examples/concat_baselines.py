"""Baselines for examples/concat_bench.rs on the same shapes: torch.cat, one cudaMemcpyAsync per
fragment (through CuPy), and the device's copy rate. Needs a GPU with torch and cupy.

    python3 examples/concat_baselines.py [--partitions 200]
"""

import argparse

import cupy as cp
import torch


def timed(fn, repeat=10):
    """Best time of `fn` in seconds, measured with CUDA events after a warm-up."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def memcpy_loop(outputs, fragments_per_output):
    stream = cp.cuda.get_current_stream()
    for out, fragments in zip(outputs, fragments_per_output):
        offset = 0
        for fragment in fragments:
            n = fragment.numel() * fragment.element_size()
            cp.cuda.runtime.memcpyAsync(out.data_ptr() + offset, fragment.data_ptr(), n, 3, stream.ptr)
            offset += n


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--partitions", type=int, default=200)
    args = parser.parse_args()
    dev = torch.device("cuda")
    print(f"{args.partitions} partitions per shape; best of 10; bytes moved = read + written")
    print(f"{'shape (per partition)':<36} {'MB moved':>10} {'torch.cat ms':>13} {'memcpy loop ms':>15}")
    for name, rows, columns, kind in [
        ("10 x int64 + nulls, 1,000 rows", 1_000, 10, "int64"),
        ("10 x int64 + nulls, 100,000 rows", 100_000, 10, "int64"),
        ("1 x utf8, 100,000 rows", 100_000, 1, "utf8"),
    ]:
        per_output = []
        for _ in range(columns):
            if kind == "int64":
                values = [torch.arange(rows, dtype=torch.int64, device=dev) for _ in range(args.partitions)]
                # Arrow validity bitmaps: one bit per row.
                masks = [torch.ones((rows + 7) // 8, dtype=torch.uint8, device=dev) for _ in range(args.partitions)]
                per_output += [values, masks]
            else:
                # Offsets and ~16 bytes of characters per row.
                offsets = [torch.arange(rows + 1, dtype=torch.int32, device=dev) for _ in range(args.partitions)]
                chars = [torch.zeros(rows * 16, dtype=torch.uint8, device=dev) for _ in range(args.partitions)]
                per_output += [offsets, chars]
        moved = 2 * sum(t.numel() * t.element_size() for fragments in per_output for t in fragments)
        outputs = [torch.cat(fragments) for fragments in per_output]
        cat_s = timed(lambda: [torch.cat(fragments) for fragments in per_output])
        loop_s = timed(lambda: memcpy_loop(outputs, per_output))
        print(f"{name:<36} {moved / 1e6:>10.1} {cat_s * 1e3:>13.3f} {loop_s * 1e3:>15.3f}")
    big = torch.empty(2 << 30, dtype=torch.uint8, device=dev)
    copy = torch.empty_like(big)
    copy_s = timed(lambda: copy.copy_(big))
    print(f"device-to-device copy: {2 * big.numel() / copy_s / 1e12:.2f} TB/s (read + write)")


if __name__ == "__main__":
    main()

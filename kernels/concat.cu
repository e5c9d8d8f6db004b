// Concatenation of many Arrow buffer fragments in one kernel launch.
//
// The host describes a whole table's concatenation as a list of tasks, one per fragment of
// every buffer of every column (values, offsets, validity and boolean bitmaps, children), and
// the exclusive scan of the work units each task needs. One launch then does everything:
// each thread takes a work unit, finds its task by binary search over the scan (the task list
// is small and stays in cache), and does that unit. No per-fragment host round trip, no
// per-fragment launch: P partitions x C columns cost one launch instead of P x C copies.
//
// Launch contract
//   gpu_flight_concat<<<grid, 256>>>(tasks, unit_starts, task_count, total_units)
//   - blockDim.x == BLOCK (256); any grid size. Each block takes tiles of TILE consecutive
//     units (grid-stride over tiles). One thread finds the tasks of the tile's first and last
//     unit by binary search over the whole scan; every thread then searches only between
//     those two for its units, which is one or two steps when tasks are large, and copies
//     UNITS_PER_THREAD units, strided by BLOCK so that a warp's accesses stay contiguous.
//   - unit_starts has task_count + 1 entries: unit_starts[t] is the first unit of task t,
//     unit_starts[task_count] == total_units. Tasks with zero units are allowed.
//   - destinations of different tasks do not overlap, except that two bit-copy tasks may
//     share the 32-bit word at their boundary; those words are updated with atomics that
//     touch only each task's own bits.
//
// Work units per task kind
//   COPY_BYTES     16 destination bytes; the widest loads and stores both addresses allow.
//   COPY_BITS      one 32-bit destination word; source bits at any bit offset, or all ones
//                  when src is 0 (a fragment without a validity bitmap).
//   REBASE_OFFS32/ one offset: dst[k] = src[k] - src[0] + base (a fragment's offsets moved
//   REBASE_OFFS64  to start at the running total of the fragments before it).

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;
typedef int i32;
typedef unsigned char u8;

enum TaskKind : u32 {
    COPY_BYTES = 0,
    COPY_BITS = 1,
    REBASE_OFFS32 = 2,
    REBASE_OFFS64 = 3,
};

// Must match `ConcatTask` in src/backend/cuda/concat.rs.
struct Task {
    u32 kind;
    u32 reserved;
    u64 src;      // device address of the source buffer (0: all-ones bitmap)
    u64 dst;      // device address of the destination buffer
    u64 count;    // bytes, bits or offsets to write
    u64 src_bit;  // COPY_BITS: first source bit
    u64 dst_bit;  // COPY_BITS: first destination bit
    i64 base;     // REBASE: the value src[0] becomes
};

__device__ __forceinline__ void copy_bytes(const Task& t, u64 unit) {
    const u64 begin = unit * 16;
    const u64 n = t.count - begin < 16 ? t.count - begin : 16;
    const u8* src = reinterpret_cast<const u8*>(t.src) + begin;
    u8* dst = reinterpret_cast<u8*>(t.dst) + begin;
    const u64 both = reinterpret_cast<u64>(src) | reinterpret_cast<u64>(dst);
    if (n == 16 && (both & 15) == 0) {
        *reinterpret_cast<uint4*>(dst) = __ldg(reinterpret_cast<const uint4*>(src));
    } else if (n == 16 && (both & 7) == 0) {
        const u64* s = reinterpret_cast<const u64*>(src);
        u64* d = reinterpret_cast<u64*>(dst);
        d[0] = __ldg(s);
        d[1] = __ldg(s + 1);
    } else if (n == 16 && (both & 3) == 0) {
        const u32* s = reinterpret_cast<const u32*>(src);
        u32* d = reinterpret_cast<u32*>(dst);
        #pragma unroll
        for (int i = 0; i < 4; ++i) d[i] = __ldg(s + i);
    } else {
        for (u64 i = 0; i < n; ++i) dst[i] = src[i];
    }
}

// `n` (<= 32) source bits starting at bit `bit`, read bytewise so that nothing past the
// source bitmap's last byte is touched.
__device__ __forceinline__ u32 read_bits(const u8* src, u64 bit, u32 n) {
    const u64 byte = bit >> 3;
    const u32 shift = static_cast<u32>(bit & 7);
    const u32 bytes = (shift + n + 7) >> 3;
    u64 window = 0;
    for (u32 i = 0; i < bytes; ++i) window |= static_cast<u64>(src[byte + i]) << (8 * i);
    const u64 mask = n == 32 ? 0xffffffffull : ((1ull << n) - 1);
    return static_cast<u32>((window >> shift) & mask);
}

__device__ __forceinline__ void copy_bits(const Task& t, u64 unit) {
    const u64 first_word = t.dst_bit >> 5;
    const u64 word = first_word + unit;
    const u64 word_begin = word << 5;
    const u64 lo = word_begin > t.dst_bit ? word_begin : t.dst_bit;
    const u64 end = t.dst_bit + t.count;
    const u64 hi = word_begin + 32 < end ? word_begin + 32 : end;
    const u32 n = static_cast<u32>(hi - lo);
    const u32 shift = static_cast<u32>(lo - word_begin);
    const u32 bits = t.src == 0
        ? (n == 32 ? 0xffffffffu : ((1u << n) - 1))
        : read_bits(reinterpret_cast<const u8*>(t.src), t.src_bit + (lo - t.dst_bit), n);
    u32* dst = reinterpret_cast<u32*>(t.dst) + word;
    if (n == 32) {
        *dst = bits;
    } else {
        const u32 mask = ((n == 32 ? 0xffffffffu : ((1u << n) - 1))) << shift;
        atomicAnd(dst, ~mask);
        atomicOr(dst, (bits << shift) & mask);
    }
}

template <typename T>
__device__ __forceinline__ void rebase(const Task& t, u64 unit) {
    const T* src = reinterpret_cast<const T*>(t.src);
    T* dst = reinterpret_cast<T*>(t.dst);
    dst[unit] = static_cast<T>(static_cast<i64>(__ldg(src + unit)) - static_cast<i64>(__ldg(src)) + t.base);
}

constexpr u32 BLOCK = 256;
constexpr u32 UNITS_PER_THREAD = 8;
constexpr u64 TILE = static_cast<u64>(BLOCK) * UNITS_PER_THREAD;

// The last task in [lo, hi] whose first unit is <= unit (skips tasks with no units).
__device__ __forceinline__ u32 find_task(const u64* __restrict__ unit_starts, u32 lo, u32 hi, u64 unit) {
    u32 end = hi + 1;
    while (end - lo > 1) {
        const u32 mid = (lo + end) >> 1;
        if (__ldg(unit_starts + mid) <= unit) lo = mid; else end = mid;
    }
    return lo;
}

extern "C" __global__ void __launch_bounds__(BLOCK) gpu_flight_concat(
    const Task* __restrict__ tasks,
    const u64* __restrict__ unit_starts,
    u32 task_count,
    u64 total_units) {
    __shared__ u32 tile_first, tile_last;
    for (u64 tile = static_cast<u64>(blockIdx.x) * TILE; tile < total_units; tile += static_cast<u64>(gridDim.x) * TILE) {
        const u64 tile_end = tile + TILE < total_units ? tile + TILE : total_units;
        if (threadIdx.x == 0) {
            tile_first = find_task(unit_starts, 0, task_count - 1, tile);
            tile_last = find_task(unit_starts, tile_first, task_count - 1, tile_end - 1);
        }
        __syncthreads();
        const u32 first = tile_first, last = tile_last;
        #pragma unroll
        for (u32 k = 0; k < UNITS_PER_THREAD; ++k) {
            const u64 unit = tile + static_cast<u64>(k) * BLOCK + threadIdx.x;
            if (unit >= tile_end) break;
            const u32 index = first == last ? first : find_task(unit_starts, first, last, unit);
            const Task t = tasks[index];
            const u64 local = unit - __ldg(unit_starts + index);
            switch (t.kind) {
                case COPY_BYTES: copy_bytes(t, local); break;
                case COPY_BITS: copy_bits(t, local); break;
                case REBASE_OFFS32: rebase<i32>(t, local); break;
                case REBASE_OFFS64: rebase<i64>(t, local); break;
                default: break;
            }
        }
        __syncthreads();
    }
}

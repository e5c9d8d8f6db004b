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
//   gpu_flight_concat<<<grid, 256>>>(tasks, unit_starts, maps, task_count, total_units)
//   - blockDim.x == BLOCK (256); any grid size. Each block takes tiles of TILE consecutive
//     units (grid-stride over tiles). The first warp finds the tasks of the tile's first and
//     last unit by a 32-way search over the whole scan (find_task_warp).
//   - A tile that spans at most MAX_SEGMENTS tasks (most tiles of any table but one of
//     tiny fragments) is done task by task, all threads on one task's part of the tile: byte
//     copies, bitmaps, offset rebases and 4-byte key remaps with all of a thread's loads in
//     flight at once (whole_tile), other kinds unit by unit without a search. A tile of more
//     tasks is done unit by unit, each thread searching between the tile's first and last
//     task for its units, strided by BLOCK so that a warp's accesses stay contiguous.
//   - __launch_bounds__(BLOCK, 3) holds the kernel at 80 registers (three blocks per SM);
//     left alone, the whole-tile paths take 128 and halve occupancy for every task.
//   - unit_starts has task_count + 1 entries: unit_starts[t] is the first unit of task t,
//     unit_starts[task_count] == total_units. Tasks with zero units are allowed.
//   - destinations of different tasks do not overlap, except that two bit-copy tasks may
//     share the 32-bit word at their boundary; those words are updated with atomics that
//     touch only each task's own bits. No other task writes a byte of a word a bit-copy task
//     writes (ZERO_BYTES tasks start after the 32-bit word a bitmap ends in).
//   - sources of bit copies are 4-byte aligned where whole tiles are to read them as words
//     (an unaligned one is copied unit by unit, read bytewise).
//
// Work units per task kind
//   COPY_BYTES     one 16-byte aligned chunk of the destination: a 16-byte store (bytewise in
//                  the task's first and last chunk), loaded at any source alignment.
//   COPY_BITS      one 32-bit destination word; source bits at any bit offset, or all ones
//                  when src is 0 (a fragment without a validity bitmap).
//   REBASE_OFFS32/ 16 source bytes of offsets (4 or 2): dst[k] = src[k] - src[0] + base (a
//   REBASE_OFFS64  fragment's offsets moved to start at the running total of those before).
//   REMAP_KEYS8..  16 source bytes of dictionary keys (16, 8, 4 or 2 keys of 1, 2, 4 or 8
//   REMAP_KEYS64   bytes): dst[k] = maps[map + src[k]], or 0 when src[k] (read unsigned) is
//                  not below map_len (only ever under a null). One 16-byte load and store
//                  where both ends are aligned, as keys of compact fragments are.
//   ZERO_BYTES     as COPY_BYTES, writing zeros (src unused): the bytes of an output that no
//                  buffer covers (alignment gaps, the allocation's rounding), zeroed in the
//                  same launch so that no earlier contents of the memory stay readable.

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
    REMAP_KEYS8 = 4,
    REMAP_KEYS16 = 5,
    REMAP_KEYS32 = 6,
    REMAP_KEYS64 = 7,
    ZERO_BYTES = 8,
};

// COPY_BITS flag: this task writes its bitmap's last bit; it also clears the bits after that
// one up to the end of their 32-bit word, which no other task writes (the bytes there are
// neither the bitmap's nor, for ZERO_BYTES, their own: see the host's planning).
constexpr u32 ZERO_TAIL = 1;

// Must match `ConcatTask` in src/backend/cuda/abi.rs, whose tests read this file to check.
struct Task {
    u32 kind;
    u32 flags;    // COPY_BITS: ZERO_TAIL
    u64 src;      // device address of the source buffer (0: all-ones bitmap)
    u64 dst;      // device address of the destination buffer
    u64 count;    // bytes, bits or offsets to write
    u64 src_bit;  // COPY_BITS: first source bit
    u64 dst_bit;  // COPY_BITS: first destination bit
    i64 base;     // REBASE: the value src[0] becomes
    u64 map;      // REMAP_KEYS: first entry of the fragment's key map in `maps`
    u64 map_len;  // REMAP_KEYS: entries in that map
};

// 16 bytes from `src`, which may have any alignment. Misaligned sources are read as aligned
// 32-bit words and shifted into place (funnel shifts), never bytewise. The words read may
// start up to 3 bytes before `src` and end up to 3 bytes after `src + 16`: still inside the
// source allocation, whose start and size are multiples of 4.
__device__ __forceinline__ uint4 load16(u64 src) {
    if ((src & 15) == 0) return __ldg(reinterpret_cast<const uint4*>(src));
    if ((src & 7) == 0) {
        const ulonglong2 v = make_ulonglong2(__ldg(reinterpret_cast<const u64*>(src)),
                                             __ldg(reinterpret_cast<const u64*>(src) + 1));
        return make_uint4(static_cast<u32>(v.x), static_cast<u32>(v.x >> 32),
                          static_cast<u32>(v.y), static_cast<u32>(v.y >> 32));
    }
    const u32* w = reinterpret_cast<const u32*>(src & ~3ull);
    const u32 w0 = __ldg(w), w1 = __ldg(w + 1), w2 = __ldg(w + 2), w3 = __ldg(w + 3);
    const u32 shift = static_cast<u32>(src & 3) * 8;
    if (shift == 0) return make_uint4(w0, w1, w2, w3);
    const u32 w4 = __ldg(w + 4);
    return make_uint4(__funnelshift_r(w0, w1, shift), __funnelshift_r(w1, w2, shift),
                      __funnelshift_r(w2, w3, shift), __funnelshift_r(w3, w4, shift));
}

// Unit `unit` of a byte copy is the destination's 16-byte aligned chunk number `unit`,
// counted from the chunk holding dst's first byte. A chunk the task covers whole gets one
// 16-byte store; the first and last chunk, shared with neighbouring tasks, are written
// bytewise, only the task's own bytes.
__device__ __forceinline__ void copy_bytes(const Task& t, u64 unit) {
    const u64 chunk = (t.dst & ~15ull) + unit * 16;
    const u64 end = t.dst + t.count;
    const u64 lo = chunk > t.dst ? chunk : t.dst;
    const u64 hi = chunk + 16 < end ? chunk + 16 : end;
    const u64 from = t.src + (lo - t.dst);
    if (lo == chunk && hi == chunk + 16) {
        *reinterpret_cast<uint4*>(chunk) = load16(from);
    } else {
        for (u64 i = 0; i < hi - lo; ++i) {
            reinterpret_cast<u8*>(lo)[i] = reinterpret_cast<const u8*>(from)[i];
        }
    }
}

// copy_bytes writing zeros.
__device__ __forceinline__ void zero_bytes(const Task& t, u64 unit) {
    const u64 chunk = (t.dst & ~15ull) + unit * 16;
    const u64 end = t.dst + t.count;
    const u64 lo = chunk > t.dst ? chunk : t.dst;
    const u64 hi = chunk + 16 < end ? chunk + 16 : end;
    if (lo == chunk && hi == chunk + 16) {
        *reinterpret_cast<uint4*>(chunk) = make_uint4(0, 0, 0, 0);
    } else {
        for (u64 at = lo; at < hi; ++at) *reinterpret_cast<u8*>(at) = 0;
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
    u32 mask = (n == 32 ? 0xffffffffu : ((1u << n) - 1)) << shift;
    if ((t.flags & ZERO_TAIL) != 0 && hi == end && shift + n < 32) mask |= 0xffffffffu << (shift + n);
    if (mask == 0xffffffffu) {
        // The whole word is this task's: bits read past n are 0, so the tail is cleared.
        *dst = bits << shift;
    } else {
        atomicAnd(dst, ~mask);
        atomicOr(dst, (bits << shift) & mask);
    }
}

// Unit `unit` of a rebase is the 16 source bytes of offsets from offset 16 / sizeof(T) * unit
// (fewer in the last unit). Sources start 64-byte aligned, so a whole unit is one load.
template <typename T>
__device__ __forceinline__ void rebase(const Task& t, u64 unit) {
    constexpr u32 PER_UNIT = 16 / sizeof(T);
    const T* src = reinterpret_cast<const T*>(t.src);
    T* dst = reinterpret_cast<T*>(t.dst);
    const u64 first = unit * PER_UNIT;
    const i64 shift = t.base - static_cast<i64>(__ldg(src));
    if (first + PER_UNIT <= t.count && ((t.src + first * sizeof(T)) & 15) == 0) {
        union { uint4 v; T items[PER_UNIT]; } in;
        in.v = __ldg(reinterpret_cast<const uint4*>(src + first));
        #pragma unroll
        for (u32 i = 0; i < PER_UNIT; ++i) {
            dst[first + i] = static_cast<T>(static_cast<i64>(in.items[i]) + shift);
        }
    } else {
        for (u64 k = first; k < t.count && k < first + PER_UNIT; ++k) {
            dst[k] = static_cast<T>(static_cast<i64>(__ldg(src + k)) + shift);
        }
    }
}

template <typename K>
__device__ __forceinline__ K mapped(const Task& t, K key, const u64* __restrict__ maps) {
    const u64 k = static_cast<u64>(key);
    return k < t.map_len ? static_cast<K>(__ldg(maps + t.map + k)) : K(0);
}

template <typename K>
__device__ __forceinline__ void remap(const Task& t, u64 unit, const u64* __restrict__ maps) {
    constexpr u32 PER_UNIT = 16 / sizeof(K);
    const K* src = reinterpret_cast<const K*>(t.src);
    K* dst = reinterpret_cast<K*>(t.dst);
    const u64 first = unit * PER_UNIT;
    if (first + PER_UNIT <= t.count && (((t.src | t.dst) + first * sizeof(K)) & 15) == 0) {
        union { uint4 v; K items[PER_UNIT]; } keys;
        keys.v = __ldg(reinterpret_cast<const uint4*>(src + first));
        #pragma unroll
        for (u32 i = 0; i < PER_UNIT; ++i) keys.items[i] = mapped(t, keys.items[i], maps);
        *reinterpret_cast<uint4*>(dst + first) = keys.v;
    } else {
        for (u64 k = first; k < t.count && k < first + PER_UNIT; ++k) {
            dst[k] = mapped(t, __ldg(src + k), maps);
        }
    }
}

constexpr u32 BLOCK = 256;
constexpr u32 UNITS_PER_THREAD = 8;
constexpr u64 TILE = static_cast<u64>(BLOCK) * UNITS_PER_THREAD;
// A tile that spans at most this many tasks is done task by task (see the kernel).
constexpr u32 MAX_SEGMENTS = 8;

// Copies `units` whole 16-byte chunks from the aligned `from` to the aligned `to`, all loads
// first, so the compiler issues them back to back.
__device__ __forceinline__ void copy_whole_tile(u64 from, u64 to, u64 units) {
    uint4 values[UNITS_PER_THREAD];
    #pragma unroll
    for (u32 k = 0; k < UNITS_PER_THREAD; ++k) {
        const u64 unit = static_cast<u64>(k) * BLOCK + threadIdx.x;
        if (unit < units) values[k] = __ldg(reinterpret_cast<const uint4*>(from) + unit);
    }
    uint4* dst = reinterpret_cast<uint4*>(to);
    #pragma unroll
    for (u32 k = 0; k < UNITS_PER_THREAD; ++k) {
        const u64 unit = static_cast<u64>(k) * BLOCK + threadIdx.x;
        if (unit < units) dst[unit] = values[k];
    }
}

// The 16 bytes from byte `offset` (1-15) of the 32 bytes `a` then `b`. `offset` is the same
// for a whole tile, so the switch does not diverge.
__device__ __forceinline__ uint4 shifted(uint4 a, uint4 b, u32 offset) {
    u32 w0, w1, w2, w3, w4;
    switch (offset >> 2) {
        case 0: w0 = a.x; w1 = a.y; w2 = a.z; w3 = a.w; w4 = b.x; break;
        case 1: w0 = a.y; w1 = a.z; w2 = a.w; w3 = b.x; w4 = b.y; break;
        case 2: w0 = a.z; w1 = a.w; w2 = b.x; w3 = b.y; w4 = b.z; break;
        default: w0 = a.w; w1 = b.x; w2 = b.y; w3 = b.z; w4 = b.w; break;
    }
    const u32 shift = (offset & 3) * 8;
    return make_uint4(__funnelshift_r(w0, w1, shift), __funnelshift_r(w1, w2, shift),
                      __funnelshift_r(w2, w3, shift), __funnelshift_r(w3, w4, shift));
}

// copy_whole_tile for a source that is not 16-byte aligned (a string column's bytes after
// the first fragment): each thread loads the aligned 16 bytes its chunk starts in, takes the
// next aligned 16 from the lane after it (the warp's last lane loads them itself), and shifts
// the chunk out of the two: one 16-byte load per chunk instead of five 4-byte ones (load16).
// Every aligned 16 bytes read holds a byte of the source, so none reaches past the 16-byte
// aligned ends of the source's allocation.
__device__ __forceinline__ void copy_shifted_tile(u64 from, u64 to, u64 units) {
    const u64 base = from & ~15ull;
    const u32 offset = static_cast<u32>(from & 15);
    const bool last_lane = (threadIdx.x & 31) == 31;
    const uint4* src = reinterpret_cast<const uint4*>(base);
    uint4 values[UNITS_PER_THREAD];
    // Chunk `units` too: the last chunk's bytes end in it.
    #pragma unroll
    for (u32 k = 0; k < UNITS_PER_THREAD; ++k) {
        const u64 unit = static_cast<u64>(k) * BLOCK + threadIdx.x;
        values[k] = unit <= units ? __ldg(src + unit) : make_uint4(0, 0, 0, 0);
    }
    uint4* dst = reinterpret_cast<uint4*>(to);
    #pragma unroll
    for (u32 k = 0; k < UNITS_PER_THREAD; ++k) {
        const u64 unit = static_cast<u64>(k) * BLOCK + threadIdx.x;
        // Every lane shuffles, whether or not it has a chunk.
        uint4 next;
        next.x = __shfl_down_sync(0xffffffffu, values[k].x, 1);
        next.y = __shfl_down_sync(0xffffffffu, values[k].y, 1);
        next.z = __shfl_down_sync(0xffffffffu, values[k].z, 1);
        next.w = __shfl_down_sync(0xffffffffu, values[k].w, 1);
        if (unit < units) {
            if (last_lane) next = __ldg(src + unit + 1);
            dst[unit] = shifted(values[k], next, offset);
        }
    }
}

// A whole tile inside one byte copy (the bulk of any large table): every thread issues all
// its loads before its first store, so each has UNITS_PER_THREAD 16-byte loads in flight
// instead of one. `local` is the tile's first unit within the task; `units` how many.
__device__ __forceinline__ void copy_tile(const Task& t, u64 local, u64 units) {
    const u64 first_chunk = (t.dst & ~15ull) + local * 16;
    if (first_chunk < t.dst || first_chunk + units * 16 > t.dst + t.count) {
        for (u32 k = 0; k < UNITS_PER_THREAD; ++k) {
            const u64 unit = static_cast<u64>(k) * BLOCK + threadIdx.x;
            if (unit < units) copy_bytes(t, local + unit);
        }
        return;
    }
    const u64 from = t.src + (first_chunk - t.dst);
    if ((from & 15) == 0) {
        copy_whole_tile(from, first_chunk, units);
    } else {
        copy_shifted_tile(from, first_chunk, units);
    }
}

// A whole tile inside one rebase, as copy_tile does for bytes: every thread loads all its
// units' offsets before it writes any, and writes each unit with one 16-byte store where the
// destination allows. The arithmetic is T's own, wrapping (the result is cast to T anyway),
// so that the tile's offsets take no more registers than its bytes. Returns false (the caller
// then does the units one by one) where the source is not 16-byte aligned or the tile's last
// unit is not whole.
template <typename T, typename U>
__device__ __forceinline__ bool rebase_tile(const Task& t, u64 local, u64 units) {
    constexpr u32 PER_UNIT = 16 / sizeof(T);
    if ((t.src & 15) != 0 || (local + units) * PER_UNIT > t.count) return false;
    const U* src = reinterpret_cast<const U*>(t.src);
    const U shift = static_cast<U>(t.base) - __ldg(src);
    uint4 values[UNITS_PER_THREAD];
    #pragma unroll
    for (u32 k = 0; k < UNITS_PER_THREAD; ++k) {
        const u64 unit = static_cast<u64>(k) * BLOCK + threadIdx.x;
        if (unit < units) values[k] = __ldg(reinterpret_cast<const uint4*>(src) + local + unit);
    }
    const bool aligned = (t.dst & 15) == 0;
    U* dst = reinterpret_cast<U*>(t.dst);
    #pragma unroll
    for (u32 k = 0; k < UNITS_PER_THREAD; ++k) {
        const u64 unit = static_cast<u64>(k) * BLOCK + threadIdx.x;
        if (unit >= units) continue;
        union { uint4 v; U items[PER_UNIT]; } out;
        out.v = values[k];
        #pragma unroll
        for (u32 i = 0; i < PER_UNIT; ++i) out.items[i] += shift;
        U* at = dst + (local + unit) * PER_UNIT;
        if (aligned) {
            *reinterpret_cast<uint4*>(at) = out.v;
        } else {
            #pragma unroll
            for (u32 i = 0; i < PER_UNIT; ++i) at[i] = out.items[i];
        }
    }
    return true;
}

// A whole tile inside one remap of 4-byte keys: all of a thread's keys loaded at once, then
// looked up (the low 32 bits of each map entry: all a 4-byte key keeps) and stored. Narrower
// keys (16 or 8 a unit) are left to the unit-by-unit path: their lookups in flight at once
// would take registers enough to cut the whole kernel's occupancy. Returns false where the
// keys are not 16-byte aligned at both ends or the tile's last unit is not whole.
__device__ __forceinline__ bool remap_tile(const Task& t, u64 local, u64 units, const u64* __restrict__ maps) {
    if (((t.src | t.dst) & 15) != 0 || (local + units) * 4 > t.count) return false;
    uint4 keys[UNITS_PER_THREAD];
    const uint4* src = reinterpret_cast<const uint4*>(t.src) + local;
    #pragma unroll
    for (u32 k = 0; k < UNITS_PER_THREAD; ++k) {
        const u64 unit = static_cast<u64>(k) * BLOCK + threadIdx.x;
        if (unit < units) keys[k] = __ldg(src + unit);
    }
    const u32* map = reinterpret_cast<const u32*>(maps + t.map);
    const u64 len = t.map_len;
    uint4* dst = reinterpret_cast<uint4*>(t.dst) + local;
    #pragma unroll
    for (u32 k = 0; k < UNITS_PER_THREAD; ++k) {
        const u64 unit = static_cast<u64>(k) * BLOCK + threadIdx.x;
        if (unit >= units) continue;
        const uint4 in = keys[k];
        dst[unit] = make_uint4(in.x < len ? __ldg(map + 2 * static_cast<u64>(in.x)) : 0u,
                               in.y < len ? __ldg(map + 2 * static_cast<u64>(in.y)) : 0u,
                               in.z < len ? __ldg(map + 2 * static_cast<u64>(in.z)) : 0u,
                               in.w < len ? __ldg(map + 2 * static_cast<u64>(in.w)) : 0u);
    }
    return true;
}

// A tile inside one bitmap copy, as copy_tile does for bytes: every thread reads the source
// words of all its units first (two aligned 32-bit words funnel-shifted where the fragment's
// bits do not start at a word), then writes whole words. The task's first and last word,
// which it may share with its neighbours (or must clear the tail of), go through copy_bits.
// Returns false where the source is not 4-byte aligned. Every word read holds a bit the task
// copies, so reads stay within the aligned words around its bits (what the host checks).
__device__ __forceinline__ bool bits_tile(const Task& t, u64 local, u64 units) {
    if ((t.src & 3) != 0) return false;
    const u64 first_word = t.dst_bit >> 5;
    const u64 last_unit = ((t.dst_bit + t.count - 1) >> 5) - first_word;
    const u32* src = reinterpret_cast<const u32*>(t.src);
    u32 values[UNITS_PER_THREAD];
    #pragma unroll
    for (u32 k = 0; k < UNITS_PER_THREAD; ++k) {
        const u64 unit = local + static_cast<u64>(k) * BLOCK + threadIdx.x;
        values[k] = 0xffffffffu;
        if (unit - local < units && unit != 0 && unit != last_unit && t.src != 0) {
            // The source bit the word's first destination bit comes from.
            const u64 bit = t.src_bit + ((first_word + unit) << 5) - t.dst_bit;
            const u32 shift = static_cast<u32>(bit & 31);
            const u32 low = __ldg(src + (bit >> 5));
            values[k] = shift == 0 ? low : __funnelshift_r(low, __ldg(src + (bit >> 5) + 1), shift);
        }
    }
    u32* dst = reinterpret_cast<u32*>(t.dst) + first_word;
    #pragma unroll
    for (u32 k = 0; k < UNITS_PER_THREAD; ++k) {
        const u64 unit = local + static_cast<u64>(k) * BLOCK + threadIdx.x;
        if (unit - local >= units) continue;
        if (unit == 0 || unit == last_unit) {
            copy_bits(t, unit);
        } else {
            dst[unit] = values[k];
        }
    }
    return true;
}

// Does the part of a tile that lies inside task `t`, where its kind has a way to (all but
// key remaps of 1, 2 or 8 bytes); false where the caller must do its units one by one.
__device__ __forceinline__ bool whole_tile(const Task& t, u64 local, u64 units, const u64* __restrict__ maps) {
    switch (t.kind) {
        case COPY_BYTES: copy_tile(t, local, units); return true;
        case COPY_BITS: return bits_tile(t, local, units);
        case ZERO_BYTES:
            for (u32 k = 0; k < UNITS_PER_THREAD; ++k) {
                const u64 unit = static_cast<u64>(k) * BLOCK + threadIdx.x;
                if (unit < units) zero_bytes(t, local + unit);
            }
            return true;
        case REBASE_OFFS32: return rebase_tile<i32, u32>(t, local, units);
        case REBASE_OFFS64: return rebase_tile<i64, u64>(t, local, units);
        case REMAP_KEYS32: return remap_tile(t, local, units, maps);
        default: return false;
    }
}

// Unit `local` of task `t`.
__device__ __forceinline__ void do_unit(const Task& t, u64 local, const u64* __restrict__ maps) {
    switch (t.kind) {
        case COPY_BYTES: copy_bytes(t, local); break;
        case COPY_BITS: copy_bits(t, local); break;
        case REBASE_OFFS32: rebase<i32>(t, local); break;
        case REBASE_OFFS64: rebase<i64>(t, local); break;
        case REMAP_KEYS8: remap<unsigned char>(t, local, maps); break;
        case REMAP_KEYS16: remap<unsigned short>(t, local, maps); break;
        case REMAP_KEYS32: remap<u32>(t, local, maps); break;
        case REMAP_KEYS64: remap<u64>(t, local, maps); break;
        case ZERO_BYTES: zero_bytes(t, local); break;
        default: break;
    }
}

// The last task in [lo, hi] whose first unit is <= unit (skips tasks with no units).
__device__ __forceinline__ u32 find_task(const u64* __restrict__ unit_starts, u32 lo, u32 hi, u64 unit) {
    u32 end = hi + 1;
    while (end - lo > 1) {
        const u32 mid = (lo + end) >> 1;
        if (__ldg(unit_starts + mid) <= unit) lo = mid; else end = mid;
    }
    return lo;
}

// find_task done by the 32 lanes of a warp together: each step probes 32 evenly spaced
// tasks at once, so a table of 4,000 tasks takes 3 dependent loads instead of 12 (every
// block starts with this, while its other threads wait). Every lane of the warp calls it and
// gets the answer. unit_starts[lo] <= unit on entry.
__device__ __forceinline__ u32 find_task_warp(const u64* __restrict__ unit_starts, u32 lo, u32 hi, u64 unit) {
    const u32 lane = threadIdx.x & 31;
    while (lo < hi) {
        // 32 segments of `step` tasks cover lo..hi; lane j probes the start of segment j.
        const u32 step = (hi - lo) / 32 + 1;
        const u64 probe = static_cast<u64>(lo) + static_cast<u64>(lane) * step;
        const bool below = probe <= hi && __ldg(unit_starts + probe) <= unit;
        // Lane 0 probes lo, which is always below.
        const u32 segment = 31 - __clz(__ballot_sync(0xffffffffu, below));
        lo += segment * step;
        hi = lo + (step - 1) < hi ? lo + (step - 1) : hi;
    }
    return lo;
}

extern "C" __global__ void __launch_bounds__(BLOCK, 3) gpu_flight_concat(
    const Task* __restrict__ tasks,
    const u64* __restrict__ unit_starts,
    const u64* __restrict__ maps,
    u32 task_count,
    u64 total_units) {
    __shared__ u32 tile_first, tile_last;
    for (u64 tile = static_cast<u64>(blockIdx.x) * TILE; tile < total_units; tile += static_cast<u64>(gridDim.x) * TILE) {
        const u64 tile_end = tile + TILE < total_units ? tile + TILE : total_units;
        if (threadIdx.x < 32) {
            const u32 first = find_task_warp(unit_starts, 0, task_count - 1, tile);
            const u32 last = find_task_warp(unit_starts, first, task_count - 1, tile_end - 1);
            if (threadIdx.x == 0) {
                tile_first = first;
                tile_last = last;
            }
        }
        __syncthreads();
        const u32 first = tile_first, last = tile_last;
        if (last - first < MAX_SEGMENTS) {
            // Few tasks: the block does each one's part of the tile in turn, all threads on
            // one task, with the whole-tile paths where the task's kind has one.
            for (u32 index = first; index <= last; ++index) {
                const u64 task_start = __ldg(unit_starts + index);
                const u64 task_end = __ldg(unit_starts + index + 1);
                const u64 lo = tile > task_start ? tile : task_start;
                const u64 hi = tile_end < task_end ? tile_end : task_end;
                if (lo >= hi) continue;
                const Task& t = tasks[index];
                if (!whole_tile(t, lo - task_start, hi - lo, maps)) {
                    #pragma unroll
                    for (u32 k = 0; k < UNITS_PER_THREAD; ++k) {
                        const u64 unit = lo + static_cast<u64>(k) * BLOCK + threadIdx.x;
                        if (unit < hi) do_unit(t, unit - task_start, maps);
                    }
                }
            }
        } else {
            // Many small tasks: each thread finds the task of each of its units.
            #pragma unroll
            for (u32 k = 0; k < UNITS_PER_THREAD; ++k) {
                const u64 unit = tile + static_cast<u64>(k) * BLOCK + threadIdx.x;
                if (unit >= tile_end) break;
                const u32 index = find_task(unit_starts, first, last, unit);
                do_unit(tasks[index], unit - __ldg(unit_starts + index), maps);
            }
        }
        __syncthreads();
    }
}

// Row filtering where the rows live: evaluate a WHERE clause on the device, then gather the
// rows it keeps, so that only those cross PCIe.
//
// A filtered read of rows [first_row, first_row + rows) of a partition runs, on one stream:
//   1. gpu_flight_filter: one thread per row runs the filter's program (postfix, SQL's
//      three-valued logic) and sets flags[i] = 1 where the answer is TRUE; each tile of TILE
//      rows writes how many it kept.
//   2. gpu_flight_scan over the tiles' counts: each tile's first output row, and the total.
//   3. For each string column kept, gpu_flight_string_bytes: the bytes of each tile's kept
//      strings, scanned again by gpu_flight_scan.
//   4. The gathers: each thread finds its row's output position from the tile's offset and
//      the flags of the rows before it in the tile (warp ballots), and copies its row's value,
//      bit or string.
// Nothing in a gather depends on the order blocks run in, and no row is written twice.
//
// Launch contract
//   - blockDim.x == TILE for every kernel; gridDim.x == ceil(rows / TILE), and one block for
//     gpu_flight_scan. Every thread of a block reaches every __syncthreads.
//   - Programs are checked on the host (src/backend/cuda/filter_abi.rs, check_program): every
//     test names a listed column, IN lists and literals lie inside the keys, strings and byte
//     pool, the stack never passes MAX_STACK and ends with one answer. The host checks every
//     buffer's extent before each launch; string offsets are clamped into their data, and a
//     dictionary key naming no string reads as the empty string.
//   - Gathers never write at or past `count` output rows (or `total` string bytes), whatever
//     the flags say, and string offsets are clamped into their data: corrupt inputs can give
//     wrong rows, never a write outside the output.
//
// Keys (must match `backend::filter::key`): every value is read as a 128-bit signed integer
// that orders as the values do; floats through the IEEE 754 total order (the bits, with all
// but the sign flipped for negative numbers), as Arrow's comparison kernels order them.
// Strings (and dictionaries of strings) compare bytewise with literals of the program's pool.

typedef unsigned long long u64;
typedef long long i64;
typedef unsigned int u32;
typedef int i32;
typedef unsigned short u16;
typedef short i16;
typedef unsigned char u8;
typedef signed char i8;

#define TILE 1024
#define MAX_STACK 16

enum Code : u32 {
    COMPARE = 0,
    IS_NULL = 1,
    IS_NOT_NULL = 2,
    CONSTANT = 3,
    ALWAYS_NULL = 4,
    IN_LIST = 5,
    AND = 6,
    OR = 7,
    NOT = 8,
    COMPARE_BYTES = 9,
    IN_STRINGS = 10,
};

enum Cmp : u32 {
    EQ = 0,
    NE = 1,
    LT = 2,
    LE = 3,
    GT = 4,
    GE = 5,
};

enum Type : u32 {
    INT8 = 1,
    INT16 = 2,
    INT32 = 3,
    INT64 = 4,
    UINT8 = 5,
    UINT16 = 6,
    UINT32 = 7,
    UINT64 = 8,
    FLOAT32 = 9,
    FLOAT64 = 10,
    INT128 = 11,
    BITS = 12,
    STRINGS = 13,     // aux: the offsets' width (4 or 8)
    DICTIONARY = 14,  // aux: the keys' Type, plus the dictionary's offsets' width times 256
};

// Three-valued answers.
#define A_FALSE 0
#define A_TRUE 1
#define A_NULL 2

// Must match `FilterKey` in src/backend/cuda/filter_abi.rs: an i128, low half first.
struct Key {
    u64 lo;
    i64 hi;
};

// Must match `FilterColumn` in src/backend/cuda/filter_abi.rs.
struct Column {
    u64 values;              // values of row 0 (bits for BITS, offsets, dictionary keys)
    u64 validity;            // the validity bitmap of row 0; 0 when no row is null
    u64 data;                // STRINGS, DICTIONARY: the strings' bytes
    u64 data_len;
    u64 dictionary_offsets;  // DICTIONARY: its strings' offsets, and how many strings
    u64 dictionary_len;
    u32 type;
    u32 aux;
};

// Must match `FilterString` in src/backend/cuda/filter_abi.rs: bytes of the program's pool.
struct Str {
    u32 start;
    u32 len;
};

// Must match `FilterOp` in src/backend/cuda/filter_abi.rs.
struct Op {
    u32 code;
    u32 column;      // tests: index into the columns table
    u32 cmp;         // COMPARE: Cmp
    u32 arg;         // CONSTANT: the answer; IN_*: whether the list held NULL; AND/OR: count
    u64 key_lo;      // COMPARE: the literal's key
    i64 key_hi;
    u32 list_start;  // IN_LIST: its sorted keys, keys[list_start .. list_start + list_len];
    u32 list_len;    // IN_STRINGS: its sorted strings; COMPARE_BYTES: the literal's bytes
};

__device__ __forceinline__ u32 bit_at(u64 bitmap, u64 i) {
    return (((const u8*)bitmap)[i >> 3] >> (i & 7)) & 1u;
}

__device__ __forceinline__ Key signed_key(i64 v) {
    Key k;
    k.lo = (u64)v;
    k.hi = v < 0 ? -1 : 0;
    return k;
}

__device__ __forceinline__ Key unsigned_key(u64 v) {
    Key k;
    k.lo = v;
    k.hi = 0;
    return k;
}

__device__ Key load_key(const Column& c, u64 row) {
    switch (c.type) {
        case INT8: return signed_key(((const i8*)c.values)[row]);
        case INT16: return signed_key(((const i16*)c.values)[row]);
        case INT32: return signed_key(((const i32*)c.values)[row]);
        case INT64: return signed_key(((const i64*)c.values)[row]);
        case UINT8: return unsigned_key(((const u8*)c.values)[row]);
        case UINT16: return unsigned_key(((const u16*)c.values)[row]);
        case UINT32: return unsigned_key(((const u32*)c.values)[row]);
        case UINT64: return unsigned_key(((const u64*)c.values)[row]);
        case FLOAT32: {
            i32 b = ((const i32*)c.values)[row];
            b ^= (i32)(((u32)(b >> 31)) >> 1);
            return signed_key(b);
        }
        case FLOAT64: {
            i64 b = ((const i64*)c.values)[row];
            b ^= (i64)(((u64)(b >> 63)) >> 1);
            return signed_key(b);
        }
        case INT128: {
            const u64* p = (const u64*)c.values + 2 * row;
            Key k;
            k.lo = p[0];
            k.hi = (i64)p[1];
            return k;
        }
        default: return unsigned_key(bit_at(c.values, row));
    }
}

__device__ __forceinline__ int key_cmp(Key a, Key b) {
    if (a.hi != b.hi) return a.hi < b.hi ? -1 : 1;
    if (a.lo != b.lo) return a.lo < b.lo ? -1 : 1;
    return 0;
}

__device__ __forceinline__ u32 holds(u32 cmp, int order) {
    switch (cmp) {
        case EQ: return order == 0;
        case NE: return order != 0;
        case LT: return order < 0;
        case LE: return order <= 0;
        case GT: return order > 0;
        default: return order >= 0;
    }
}

__device__ u32 in_list(const Key* keys, u32 start, u32 len, Key k) {
    u32 lo = start, hi = start + len;
    while (lo < hi) {
        u32 mid = lo + (hi - lo) / 2;
        int order = key_cmp(keys[mid], k);
        if (order == 0) return 1;
        if (order < 0) lo = mid + 1; else hi = mid;
    }
    return 0;
}

// The byte range of string `row`, clamped into its data.
__device__ void string_span(u64 offsets, u32 width, u64 data_len, u64 row, u64* start,
                            u64* len) {
    i64 a, b;
    if (width == 4) {
        a = ((const i32*)offsets)[row];
        b = ((const i32*)offsets)[row + 1];
    } else {
        a = ((const i64*)offsets)[row];
        b = ((const i64*)offsets)[row + 1];
    }
    const u64 s = a < 0 ? 0 : ((u64)a > data_len ? data_len : (u64)a);
    const u64 e = b < (i64)s ? s : ((u64)b > data_len ? data_len : (u64)b);
    *start = s;
    *len = e - s;
}

// The string of a STRINGS or DICTIONARY column in `row` (a key naming no string of its
// dictionary, which Arrow allows only under a NULL, reads as the empty string).
__device__ void load_bytes(const Column& c, u64 row, const u8** bytes, u64* len) {
    u64 offsets = c.values, index = row;
    u32 width = c.aux & 0xff;
    if (c.type == DICTIONARY) {
        Column keys = c;
        keys.type = c.aux & 0xff;
        const Key k = load_key(keys, row);
        if (k.hi != 0 || k.lo >= c.dictionary_len) {
            *bytes = (const u8*)c.data;
            *len = 0;
            return;
        }
        offsets = c.dictionary_offsets;
        index = k.lo;
        width = c.aux >> 8;
    }
    u64 start;
    string_span(offsets, width, c.data_len, index, &start, len);
    *bytes = (const u8*)c.data + start;
}

// Arrow's order of strings: bytewise, a prefix first.
__device__ int bytes_cmp(const u8* a, u64 a_len, const u8* b, u64 b_len) {
    const u64 n = a_len < b_len ? a_len : b_len;
    for (u64 i = 0; i < n; ++i) {
        if (a[i] != b[i]) return a[i] < b[i] ? -1 : 1;
    }
    return a_len < b_len ? -1 : (a_len > b_len ? 1 : 0);
}

__device__ u32 in_strings(const Str* strings, const u8* pool, u32 start, u32 len,
                          const u8* s, u64 s_len) {
    u32 lo = start, hi = start + len;
    while (lo < hi) {
        const u32 mid = lo + (hi - lo) / 2;
        const int order = bytes_cmp(pool + strings[mid].start, strings[mid].len, s, s_len);
        if (order == 0) return 1;
        if (order < 0) lo = mid + 1; else hi = mid;
    }
    return 0;
}

// The answer of one test on one row.
__device__ u8 test(const Op& op, const Column* columns, const Key* keys, const Str* strings,
                   const u8* pool, u64 row) {
    const Column c = columns[op.column];
    const bool valid = c.validity == 0 || bit_at(c.validity, row);
    if (op.code == IS_NULL) return valid ? A_FALSE : A_TRUE;
    if (op.code == IS_NOT_NULL) return valid ? A_TRUE : A_FALSE;
    if (!valid || op.code == ALWAYS_NULL) return A_NULL;
    if (op.code == CONSTANT) return op.arg ? A_TRUE : A_FALSE;
    if (op.code == COMPARE_BYTES || op.code == IN_STRINGS) {
        const u8* s;
        u64 s_len;
        load_bytes(c, row, &s, &s_len);
        if (op.code == IN_STRINGS) {
            if (in_strings(strings, pool, op.list_start, op.list_len, s, s_len)) return A_TRUE;
            return op.arg ? A_NULL : A_FALSE;
        }
        const int order = bytes_cmp(s, s_len, pool + op.list_start, op.list_len);
        return holds(op.cmp, order) ? A_TRUE : A_FALSE;
    }
    const Key k = load_key(c, row);
    if (op.code == IN_LIST) {
        if (in_list(keys, op.list_start, op.list_len, k)) return A_TRUE;
        return op.arg ? A_NULL : A_FALSE;
    }
    Key literal;
    literal.lo = op.key_lo;
    literal.hi = op.key_hi;
    return holds(op.cmp, key_cmp(k, literal)) ? A_TRUE : A_FALSE;
}

// The exclusive prefix of `flag` over the block's threads, in thread order.
__device__ u32 block_rank(u32 flag) {
    __shared__ u32 warp_counts[TILE / 32];
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u32 ballot = __ballot_sync(0xffffffffu, flag);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    if (warp == 0) {
        const u32 own = warp_counts[lane];
        u32 inclusive = own;
        for (u32 d = 1; d < 32; d <<= 1) {
            const u32 other = __shfl_up_sync(0xffffffffu, inclusive, d);
            if (lane >= d) inclusive += other;
        }
        warp_counts[lane] = inclusive - own;
    }
    __syncthreads();
    return warp_counts[warp] + __popc(ballot & ((1u << lane) - 1u));
}

// The exclusive prefix sum of `value` over the block's threads, in thread order.
__device__ u64 block_exclusive(u64 value) {
    __shared__ u64 warp_totals[TILE / 32];
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u64 inclusive = value;
    for (u32 d = 1; d < 32; d <<= 1) {
        const u64 other = __shfl_up_sync(0xffffffffu, inclusive, d);
        if (lane >= d) inclusive += other;
    }
    if (lane == 31) warp_totals[warp] = inclusive;
    __syncthreads();
    if (warp == 0) {
        const u64 own = warp_totals[lane];
        u64 running = own;
        for (u32 d = 1; d < 32; d <<= 1) {
            const u64 other = __shfl_up_sync(0xffffffffu, running, d);
            if (lane >= d) running += other;
        }
        warp_totals[lane] = running - own;
    }
    __syncthreads();
    return warp_totals[warp] + inclusive - value;
}

extern "C" __global__ void __launch_bounds__(TILE) gpu_flight_filter(
    const Column* columns, const Op* ops, u32 op_count, const Key* keys, const Str* strings,
    const u8* pool, u64 first_row, u64 rows, u8* flags, u64* tile_counts) {
    const u64 i = (u64)blockIdx.x * TILE + threadIdx.x;
    u32 keep = 0;
    if (i < rows) {
        const u64 row = first_row + i;
        // The stack of answers, two bits each in one register (no local memory): entry k at
        // bits 2k and 2k + 1. The host checked that it never holds more than MAX_STACK.
        u32 stack = 0, top = 0;
        for (u32 k = 0; k < op_count; ++k) {
            const Op& op = ops[k];
            u32 answer;
            if (op.code == AND || op.code == OR) {
                // AND: false beats NULL beats true; OR: true beats NULL beats false.
                const u32 wins = op.code == AND ? A_FALSE : A_TRUE;
                answer = op.code == AND ? A_TRUE : A_FALSE;
                for (u32 n = 0; n < op.arg; ++n) {
                    --top;
                    const u32 a = (stack >> (2 * top)) & 3u;
                    if (a == wins) answer = wins;
                    else if (a == A_NULL && answer != wins) answer = A_NULL;
                }
            } else if (op.code == NOT) {
                --top;
                const u32 a = (stack >> (2 * top)) & 3u;
                answer = a == A_NULL ? A_NULL : (a == A_TRUE ? A_FALSE : A_TRUE);
            } else {
                answer = test(op, columns, keys, strings, pool, row);
            }
            stack = (stack & ~(3u << (2 * top))) | (answer << (2 * top));
            ++top;
        }
        keep = top == 1 && (stack & 3u) == A_TRUE;
        flags[i] = (u8)keep;
    }
    const u32 kept = __syncthreads_count(keep);
    if (threadIdx.x == 0) tile_counts[blockIdx.x] = kept;
}

// out[i] = in[0] + ... + in[i - 1] for i in 0..=n (out[n] is the total). One block.
extern "C" __global__ void __launch_bounds__(TILE) gpu_flight_scan(const u64* in, u64 n,
                                                                   u64* out) {
    __shared__ u64 sums[TILE];
    const u64 per = (n + TILE - 1) / TILE;
    const u64 begin = threadIdx.x * per;
    const u64 end = begin + per < n ? begin + per : n;
    u64 own = 0;
    for (u64 i = begin; i < end; ++i) own += in[i];
    sums[threadIdx.x] = own;
    __syncthreads();
    for (u32 d = 1; d < TILE; d <<= 1) {
        const u64 other = threadIdx.x >= d ? sums[threadIdx.x - d] : 0;
        __syncthreads();
        sums[threadIdx.x] += other;
        __syncthreads();
    }
    u64 running = sums[threadIdx.x] - own;
    for (u64 i = begin; i < end; ++i) {
        const u64 v = in[i];
        out[i] = running;
        running += v;
    }
    if (threadIdx.x == TILE - 1) out[n] = sums[TILE - 1];
}

__device__ __forceinline__ void write_offset(u64 offsets, u32 width, u64 at, u64 value) {
    if (width == 4) ((i32*)offsets)[at] = (i32)value;
    else ((i64*)offsets)[at] = (i64)value;
}

// tile_bytes[tile] = bytes of the tile's kept strings.
extern "C" __global__ void __launch_bounds__(TILE) gpu_flight_string_bytes(
    const u8* flags, u64 first_row, u64 rows, u64 offsets, u32 width, u64 data_len,
    u64* tile_bytes) {
    const u64 i = (u64)blockIdx.x * TILE + threadIdx.x;
    u64 start = 0, len = 0;
    if (i < rows && flags[i]) string_span(offsets, width, data_len, first_row + i, &start, &len);
    const u64 before = block_exclusive(len);
    if (threadIdx.x == TILE - 1) tile_bytes[blockIdx.x] = before + len;
}

extern "C" __global__ void __launch_bounds__(TILE) gpu_flight_gather_fixed(
    const u8* flags, const u64* tile_offsets, u64 first_row, u64 rows, u64 count, u32 width,
    u64 src, u64 dst) {
    const u64 i = (u64)blockIdx.x * TILE + threadIdx.x;
    const u32 flag = i < rows ? flags[i] : 0;
    const u32 rank = block_rank(flag);
    const u64 at = tile_offsets[blockIdx.x] + rank;
    if (!flag || at >= count) return;
    const u64 row = first_row + i;
    switch (width) {
        case 1: ((u8*)dst)[at] = ((const u8*)src)[row]; break;
        case 2: ((u16*)dst)[at] = ((const u16*)src)[row]; break;
        case 4: ((u32*)dst)[at] = ((const u32*)src)[row]; break;
        case 8: ((u64*)dst)[at] = ((const u64*)src)[row]; break;
        case 16:
            ((u64*)dst)[2 * at] = ((const u64*)src)[2 * row];
            ((u64*)dst)[2 * at + 1] = ((const u64*)src)[2 * row + 1];
            break;
        default:
            for (u32 b = 0; b < width; ++b)
                ((u8*)dst)[at * width + b] = ((const u8*)src)[row * width + b];
    }
}

// Sets the output bits of kept rows whose source bit is set; `dst` starts zeroed and 4-byte
// aligned, and spans whole 32-bit words.
extern "C" __global__ void __launch_bounds__(TILE) gpu_flight_gather_bits(
    const u8* flags, const u64* tile_offsets, u64 first_row, u64 rows, u64 count, u64 src,
    u64 dst) {
    const u64 i = (u64)blockIdx.x * TILE + threadIdx.x;
    const u32 flag = i < rows ? flags[i] : 0;
    const u32 rank = block_rank(flag);
    const u64 at = tile_offsets[blockIdx.x] + rank;
    if (!flag || at >= count || !bit_at(src, first_row + i)) return;
    atomicOr((u32*)dst + (at >> 5), 1u << (at & 31));
}

extern "C" __global__ void __launch_bounds__(TILE) gpu_flight_gather_strings(
    const u8* flags, const u64* tile_offsets, const u64* tile_bytes, u64 first_row, u64 rows,
    u64 count, u64 total, u32 width, u64 src_offsets, u64 src_data, u64 data_len,
    u64 dst_offsets, u64 dst_data) {
    const u64 i = (u64)blockIdx.x * TILE + threadIdx.x;
    const u32 flag = i < rows ? flags[i] : 0;
    u64 start = 0, len = 0;
    if (flag) string_span(src_offsets, width, data_len, first_row + i, &start, &len);
    const u32 rank = block_rank(flag);
    const u64 before = block_exclusive(len);
    const u64 at = tile_offsets[blockIdx.x] + rank;
    if (!flag || at >= count) return;
    u64 to = tile_bytes[blockIdx.x] + before;
    if (to > total) to = total;
    if (len > total - to) len = total - to;
    write_offset(dst_offsets, width, at, to);
    if (at + 1 == count) write_offset(dst_offsets, width, count, to + len);
    const u8* from = (const u8*)src_data + start;
    u8* into = (u8*)dst_data + to;
    for (u64 b = 0; b < len; ++b) into[b] = from[b];
}

// launch.h: the torch-free interface of the scoring kernel: one parameter struct, one launcher.
//
// Python owns every buffer; this layer only receives raw pointers, integers and a stream, so the
// kernel source compiles on its own (see .ci/compile-kernels).
#pragma once

#include <stdint.h>

namespace cpindex {

constexpr int kMaxHeads = 8;   // one mma.n8 column per head
constexpr int kMaxWorld = 16;  // peers one push kernel can address
constexpr int kMaxDst = 16;    // head destinations: max(num_heads, world) with replication
constexpr int kPageTokens = 128;
constexpr int kHeadDim = 128;
constexpr int kWarpsPerCta = 4;

// kNVFP4Narrow: nvfp4 whose value tokens are only 8-byte aligned (vLLM's 72-byte tokens). A
// kernel of its own: one kernel with both load widths holds both paths' registers.
enum CacheFormat : int { kBF16 = 0, kFP8 = 1, kNVFP4 = 2, kNVFP4Narrow = 3 };

// CP_FORMATS (set by kernels/build.py): a bit per CacheFormat whose scoring instances this module
// holds. The build makes one module per cache format (nvfp4: kNVFP4 and kNVFP4Narrow) and a base
// module with none (the writer, merge, hash and peer-memory functions), so a process compiles
// and loads only the formats it uses. Unset: every format.
#ifndef CP_FORMATS
#define CP_FORMATS 0xF
#endif
constexpr bool format_built(int format) {
  return format >= 0 && format < 4 && ((CP_FORMATS >> format) & 1);
}

// Error codes written to ErrorWord::code (0 = fine). Shared with cpindex/kernels/errors.py.
enum ErrorCode : uint32_t {
  kErrNone = 0,
  kErrTimeoutQueries = 1,  // waited too long for a peer's query rows
  kErrTimeoutScores = 2,   // waited too long for a peer's scores
  kErrBadPage = 3,         // block_table held a page index outside the cache
  kErrWidth = 4,           // a row needs more blocks than width or block_table provides
  kErrLength = 5,          // a request's seq_len is shorter than its query_len
  kErrMismatch = 6,        // a peer's call is not this call (shape, forcing or configuration)
  kErrSlot = 7,            // write_keys: a slot past the cache (peer: the token, detail: the slot)
  kErrTag = 8,             // a peer's call carries another tag
  kErrAgreement = 9,       // a peer read other block-table entries or lengths (outputs poisoned)
  kErrReplica = 10,        // a replica of a head delivered other queries (outputs poisoned)
};

// Lives in host-mapped pinned memory so the host reads it without a device sync.
struct ErrorWord {
  uint32_t code;
  uint32_t rank;  // who noticed
  uint32_t peer;  // who was late (or the row, for kErrBadPage; the token, for kErrSlot)
  uint32_t claim; // first writer wins
  uint64_t call;  // the call count that failed (1-based)
  uint64_t detail;
  uint64_t mine;  // kErrTag / kErrAgreement: this rank's value (detail: the peer's)
};
static_assert(sizeof(ErrorWord) == 40, "ErrorWord layout is shared with Python");

// Per-rank handshake state in peer-visible memory (see docs/design.md).
struct PushState {
  uint64_t* calls;     // local, [1]: completed calls; advanced by the kernel
  uint32_t* ticket;    // local, [1]: CTAs finished in this call; reset by the last one
  uint64_t* q_flags;   // local, [world]: slot p = last call whose queries rank p delivered here
  uint64_t* s_flags;   // local, [world]: slot p = last call whose scores rank p delivered here
  uint8_t* peer_q_slot[kMaxWorld];    // where my query rows go in rank p's query buffer
  uint64_t* peer_q_flag[kMaxWorld];   // &q_flags[my rank] on rank p
  uint64_t* peer_s_flag[kMaxWorld];   // &s_flags[my rank] on rank p
  uint64_t* peer_q_ident[kMaxWorld];  // &q_idents[my rank] on rank p: my call's identity
  uint64_t* peer_q_tag[kMaxWorld];    // &q_tags[my rank] on rank p: my call's tag
  uint64_t* peer_fp[kMaxWorld];       // &fps[my rank] on rank p: my call's agreement hash
  uint32_t* barrier;                  // local, [1]: CTAs past scoring (select mode); reset by the last
  const uint64_t* q_idents;           // local, [world]: identity of each rank's delivered call
  const uint64_t* q_tags;             // local, [world]: tag of each rank's delivered call
  const uint64_t* fps;                // local, [world]: each rank's agreement hash of the call
  unsigned long long* fp_acc;         // local, [2]: this rank's hash being summed (call parity)
  const uint8_t* q_src;               // my query rows, [rows, q_src_bytes_per_row] contiguous
  int64_t q_bytes;                    // rows * heads_per_rank * 128 * elem size
  uint64_t timeout_ticks;
};

struct ScoreParams {
  // keys, in bytes: token t of page p at kv + p * kv_page_stride + t * kv_token_stride; nvfp4
  // scales of that token at ks + p * ks_page_stride + t * ks_token_stride (page-major pages,
  // the (packed, scales) pair and other in-page layouts differ only in these four numbers)
  const uint8_t* kv;
  const uint8_t* ks;
  int64_t kv_page_stride;
  int64_t ks_page_stride;
  int64_t kv_token_stride;
  int64_t ks_token_stride;
  int64_t num_pages;
  // nvfp4: [256 scale bytes][16]: f16 high bytes (0..7) and low bytes (8..15) of
  // e4m3_rn_satfinite(magnitude * scale) for the 8 e2m1 magnitudes
  const uint8_t* fp4_lut;
  // queries: head h of row i at q + (h / q_heads_per_src) * q_src_stride + i * q_row_stride
  //          + (h % q_heads_per_src) * 128 * elem, in bytes
  const uint8_t* q;
  int64_t q_src_stride;
  int64_t q_row_stride;
  int q_heads_per_src;
  uint32_t q_src_magic;  // ceil(2^16 / q_heads_per_src): keys.h, div_small
  // block table and lengths (int32)
  const int32_t* block_table;
  int64_t bt_row_stride;
  int64_t bt_cols;  // a row needing more blocks than this is reported, never read past
  const int32_t* seq_lens;
  // problem: requests * query_len query rows, request-major; block_table/seq_lens per request
  int requests, query_len, width, num_heads, rank, world, init_blocks, local_blocks;
  float scale;  // sm_scale, before the format's unit correction
  uint32_t heads_magic;  // ceil(2^16 / num_heads): keys.h, div_small
  // output: head h, copy c -> dst[h * dst_copies + c] + row * out_row_stride + column,
  // column = j (full layout) or k = (j - rank) / world (shard layout)
  float* dst[kMaxDst];
  int dst_copies;
  int shard_columns;
  int64_t out_row_stride;
  uint64_t ident;       // push mode: this call's identity (shape, forcing, config); all ranks equal
  uint64_t tag;         // push mode: the caller's tag (patched per call; 2**63: none)
  int agree;            // push mode: hash the block-table entries and lengths the call reads
                        // (and compare replicas' queries); every rank must hold the same
  int64_t poison_count; // elements of this rank's outputs a failed agreement poisons
  float* poison;        // score_push: this rank's [heads_per_rank, rows, width] scores (NaN);
                        // local mode with trailer: the shard
  // select mode (topk > 0): dst is this rank's shard ([heads][rows][kw], shard_columns);
  // its top-k candidates per (row, head h) go to cand_dst[h * cand_copies + c], the owners'
  // [rows][topk] int64 blocks for this rank; each owner merges its own
  // cand[world][heads_per_rank][rows][topk] into ids_out/scores_out [heads_per_rank][rows][topk].
  // Push mode does it all in one launch; local mode (collective) writes the candidates into its
  // all-to-all's send buffer, and launch_merge merges what the all-to-all delivered.
  int topk;
  int heads_per_rank;
  int cand_copies;
  int64_t* cand_dst[kMaxDst];
  const int64_t* cand;
  int32_t* ids_out;
  float* scores_out;
  ErrorWord* err;       // device memory: checked by every CTA at start
  ErrorWord* err_host;  // host-mapped mirror the host polls without a sync (may be null)
  // local mode, the collective transport's agreement (agree.h; a kernel launched after the
  // scoring): > 0, the byte offset of the trailers in each source's slot of the gathered
  // queries; 0: none
  int64_t trailer;
  uint64_t* local_state;  // with trailer: device [calls, verdict], written by the first CTA
};

// The key writer's arguments: `tokens` keys, row i at keys + i * key_row_stride bytes (128
// contiguous values of key_dtype: 0 fp32, 1 bf16, 2 fp16), written at slots[i] = page * 128 +
// token (slot < 0: skipped; slot >= num_pages * 128: skipped and reported, kErrSlot) into the
// cache of `format` (kBF16, kFP8, kNVFP4): token t of page p at kv + p * kv_page_stride + t *
// kv_token_stride (nvfp4 values; their scales at ks + p * ks_page_stride + t * ks_token_stride).
struct WriteParams {
  const uint8_t* keys;
  int64_t key_row_stride;
  int key_dtype;
  int format;
  const int64_t* slots;
  int64_t tokens;
  uint8_t* kv;
  uint8_t* ks;
  int64_t kv_page_stride;
  int64_t kv_token_stride;
  int64_t ks_page_stride;
  int64_t ks_token_stride;
  int64_t num_pages;
  ErrorWord* err;       // device memory
  ErrorWord* err_host;  // host-mapped mirror (may be null)
  int rank;             // reported as the rank that noticed (the binding writes 0)
};

// Quantizes and writes the keys on `stream` (no sync; graph-capturable). nvfp4: per 16 values,
// scale = max(e4m3_rn_satfinite(max(amax, 1e-12) / 6), 2^-9), codes the e2m1 of value / scale
// (ties to even, beyond 6 saturating, never -0), value 2i in the low nibble; fp8: e4m3 of the
// value clamped to +-448, ties to even; bf16: rounded to nearest even. All in fp32 with correctly
// rounded divisions. Returns 0 or a cudaError_t/hipError_t value (-1: bad format or key dtype).
int launch_write_keys(const WriteParams& w, void* stream);

// The plan fingerprint's arguments (cpindex/fingerprint.py): block_table int32 rows of
// `cols` entries, bt_row_stride apart; seq_lens int32 [requests]; out one int64.
struct FingerprintParams {
  const int32_t* block_table;
  int64_t bt_row_stride;
  int64_t cols;
  const int32_t* seq_lens;
  int64_t requests;
  int64_t init_blocks;
  int64_t local_blocks;
  int64_t* out;
};

// Writes the fingerprint of (block_table, seq_lens) into *out on `stream`: one small launch, no
// sync, graph-capturable. Returns 0 or a cudaError_t/hipError_t value.
int launch_plan_fingerprint(const FingerprintParams& f, void* stream);

// Launches one scoring call. push == nullptr: local mode (scores into dst, no handshake; with
// p.trailer > 0 or p.topk > 0 the collective transport's agreement and shard selection follow).
// Otherwise push mode: deliver queries and the call identity, wait for peers' (and compare
// identities), score, push, signal, wait.
// The instance is the launcher's choice (cpindex/kernels/variants.py), taken as it is: `format`
// (CacheFormat), `tiles` query n-tiles per pass (1, 2 or 4), `wgmma` the warpgroup-mma instance,
// `split` 4 or 2 warps sharing each page (0: a warp per item). Returns 0, -1 where this module
// holds no such instance (score_has_instance), or a cudaError_t/hipError_t value.
int launch_score(const ScoreParams& p, const PushState* push, int format, int tiles, bool wgmma,
                 int split, int grid, void* stream);

// The collective transport's merge, after its all-to-all of a local select call's candidates:
// p.cand [world][heads_per_rank][rows][topk] into ids_out/scores_out (NaN and -1 where that
// call's ranks disagreed). Returns 0 or a cudaError_t/hipError_t value.
int launch_merge(const ScoreParams& p, void* stream);

// CTAs per SM of the instance launch_score runs for the same (format, tiles, wgmma, split), for
// the persistent-grid cap. Returns as launch_score.
int score_occupancy(int format, int tiles, bool wgmma, int split, int* ctas_per_sm);

// Whether this module holds instance (format, tiles, wgmma, split).
bool score_has_instance(int format, int tiles, bool wgmma, int split);

}  // namespace cpindex

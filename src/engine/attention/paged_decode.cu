// Paged decode attention on CUDA: one new query per sequence against its whole KV sequence, read in place from the
// paged pool through the sequence's block table (no gathered copy of the keys, no score matrix in device memory,
// one launch per layer). Compiled to PTX by build.rs when the `cuda` feature is on; launched by
// src/engine/attention/decode_cuda.rs, which documents the arguments.
//
// One thread block per (sequence, head), THREADS threads. The keys are walked CHUNK positions at a time:
//   1. scores: each thread scores one key of the chunk, reading its row 16 bytes at a time (all of them issued
//      before the first is used: the first version, a warp per key reduced with shuffles, kept one row in flight
//      per warp and spent 50 us a layer at batch 1 waiting on memory); scale and soft-cap applied, stored in shared
//      memory with the key's pool slot;
//   2. the chunk's maximum (block reduction); the running maximum m is raised to it, and the running sum and the
//      weighted values are rescaled by exp(m_old - m_new) (flash attention's online softmax);
//   3. values: each thread owns one (or, for heads wider than THREADS, several) of the head's dimensions for one
//      group of keys (key j goes to group j % groups), and accumulates p_j * v_j[d] and p_j in f32 registers, four
//      keys' loads in flight at a time;
// at the end the groups' sums are added in shared memory and each dimension is divided by the sum of p.
// Everything is f32 whatever the storage type; positions before a sliding window's start are never read.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#define THREADS 128
#define WARPS (THREADS / 32)
#define CHUNK 128
#define MAX_HEAD_DIM 512
#define MAX_DIMS_PER_THREAD (MAX_HEAD_DIM / THREADS)

__device__ __forceinline__ float2 load2(const float *p) { return *reinterpret_cast<const float2 *>(p); }
__device__ __forceinline__ float2 load2(const __nv_bfloat16 *p) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(p));
}
__device__ __forceinline__ float2 load2(const __half *p) { return __half22float2(*reinterpret_cast<const __half2 *>(p)); }

__device__ __forceinline__ float load1(const float *p) { return *p; }
__device__ __forceinline__ float load1(const __nv_bfloat16 *p) { return __bfloat162float(*p); }
__device__ __forceinline__ float load1(const __half *p) { return __half2float(*p); }

__device__ __forceinline__ void store1(float *p, float x) { *p = x; }
__device__ __forceinline__ void store1(__nv_bfloat16 *p, float x) { *p = __float2bfloat16(x); }
__device__ __forceinline__ void store1(__half *p, float x) { *p = __float2half(x); }

// The dot product of 16 bytes of a key row with the matching query values, a pair of elements at a time.
template <typename T>
__device__ __forceinline__ float dot16(uint4 u, const float *q, float dot) {
  const T *e = reinterpret_cast<const T *>(&u);
#pragma unroll
  for (int k = 0; k < 8 / (int)sizeof(T); ++k) {
    const float2 f = load2(e + 2 * k);
    dot = fmaf(q[2 * k], f.x, dot);
    dot = fmaf(q[2 * k + 1], f.y, dot);
  }
  return dot;
}

// q: [sequences, heads, head_dim]; keys, values: [slots, kv_heads, head_dim] (slot = block id x block + offset);
// tables: [sequences, width] block ids; lens: [sequences] positions visible to the query (the cache and the new
// one); out: [sequences, heads, head_dim]. head_dim even and at most MAX_HEAD_DIM; heads a multiple of kv_heads.
// softcap 0: none; window 0: none (else the query sees its own position and the window - 1 before it). vec16: every
// key row starts 16-byte aligned and is a whole number of 16 bytes (else rows are read 4 bytes at a time).
template <typename T>
__device__ void paged_decode(const T *__restrict__ q, const T *__restrict__ keys, const T *__restrict__ values,
                             const uint32_t *__restrict__ tables, const uint32_t *__restrict__ lens, T *__restrict__ out,
                             int heads, int kv_heads, int head_dim, int width, int block, float scale, float softcap,
                             int window, int vec16) {
  __shared__ float qs[MAX_HEAD_DIM];
  __shared__ float scores[CHUNK];
  __shared__ uint32_t slots[CHUNK];
  __shared__ float reduce[WARPS];
  __shared__ float group_acc[THREADS];
  __shared__ float group_sum[THREADS];

  const int seq = blockIdx.y, head = blockIdx.x;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int kv_head = head / (heads / kv_heads);
  const int len = (int)lens[seq];
  const int first = (window > 0 && len > window) ? len - window : 0;
  const size_t row_stride = (size_t)kv_heads * head_dim;
  const T *k_base = keys + (size_t)kv_head * head_dim;
  const T *v_base = values + (size_t)kv_head * head_dim;
  const uint32_t *table = tables + (size_t)seq * width;

  const T *qrow = q + ((size_t)seq * heads + head) * head_dim;
  for (int d = tid; d < head_dim; d += THREADS) qs[d] = load1(qrow + d);

  // Value layout: groups of head_dim threads when a head is narrower than the block, else one group whose threads
  // own dimensions tid, tid + THREADS, ...
  const int groups = head_dim < THREADS ? THREADS / head_dim : 1;
  const int group = head_dim < THREADS ? tid / head_dim : 0;
  const bool owner = head_dim < THREADS ? tid < groups * head_dim : true;
  const int dim0 = head_dim < THREADS ? tid % head_dim : tid;

  float m = -INFINITY;
  float sum = 0.f;
  float acc[MAX_DIMS_PER_THREAD];
#pragma unroll
  for (int i = 0; i < MAX_DIMS_PER_THREAD; ++i) acc[i] = 0.f;
  __syncthreads();

  const int pairs = head_dim / 2;
  constexpr int PER_VEC = 16 / sizeof(T);
  const int vecs = head_dim / PER_VEC;
  for (int start = first; start < len; start += CHUNK) {
    const int n = min(CHUNK, len - start);
    // 1. scores.
    for (int j = tid; j < n; j += THREADS) {
      const int pos = start + j;
      const uint32_t slot = table[pos / block] * (uint32_t)block + (uint32_t)(pos % block);
      const T *krow = k_base + (size_t)slot * row_stride;
      float dot = 0.f;
      if (vec16) {
        const uint4 *k16 = reinterpret_cast<const uint4 *>(krow);
#pragma unroll 8
        for (int i = 0; i < vecs; ++i) dot = dot16<T>(k16[i], qs + i * PER_VEC, dot);
      } else {
#pragma unroll 8
        for (int i = 0; i < pairs; ++i) {
          const float2 k2 = load2(krow + 2 * i);
          dot = fmaf(qs[2 * i], k2.x, dot);
          dot = fmaf(qs[2 * i + 1], k2.y, dot);
        }
      }
      float s = dot * scale;
      if (softcap > 0.f) s = tanhf(s / softcap) * softcap;
      scores[j] = s;
      slots[j] = slot;
    }
    __syncthreads();
    // 2. the chunk's maximum, and the running state rescaled to it.
    float top = -INFINITY;
    for (int j = tid; j < n; j += THREADS) top = fmaxf(top, scores[j]);
#pragma unroll
    for (int o = 16; o > 0; o /= 2) top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, o));
    if (lane == 0) reduce[warp] = top;
    __syncthreads();
    top = reduce[0];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) top = fmaxf(top, reduce[w]);
    const float m_new = fmaxf(m, top);
    const float alpha = expf(m - m_new);  // 0 for the first chunk (m = -inf)
    m = m_new;
    sum *= alpha;
#pragma unroll
    for (int i = 0; i < MAX_DIMS_PER_THREAD; ++i) acc[i] *= alpha;
    for (int j = tid; j < n; j += THREADS) scores[j] = expf(scores[j] - m_new);
    __syncthreads();
    // 3. values.
    if (owner) {
      int j = group;
      // Four keys at a time: their loads issued together.
      for (; j + 3 * groups < n; j += 4 * groups) {
        float p[4];
        const T *vrow[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          p[u] = scores[j + u * groups];
          vrow[u] = v_base + (size_t)slots[j + u * groups] * row_stride;
        }
#pragma unroll
        for (int i = 0; i < MAX_DIMS_PER_THREAD; ++i) {
          const int d = dim0 + i * THREADS;
          if (d < head_dim) {
            float v[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) v[u] = load1(vrow[u] + d);
#pragma unroll
            for (int u = 0; u < 4; ++u) acc[i] = fmaf(p[u], v[u], acc[i]);
          }
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) sum += p[u];
      }
      for (; j < n; j += groups) {
        const float p = scores[j];
        const T *vrow = v_base + (size_t)slots[j] * row_stride;
        sum += p;
#pragma unroll
        for (int i = 0; i < MAX_DIMS_PER_THREAD; ++i) {
          const int d = dim0 + i * THREADS;
          if (d < head_dim) acc[i] = fmaf(p, load1(vrow + d), acc[i]);
        }
      }
    }
    __syncthreads();  // scores and slots are rewritten by the next chunk
  }

  T *orow = out + ((size_t)seq * heads + head) * head_dim;
  if (groups == 1) {
#pragma unroll
    for (int i = 0; i < MAX_DIMS_PER_THREAD; ++i) {
      const int d = dim0 + i * THREADS;
      if (owner && d < head_dim) store1(orow + d, acc[i] / sum);
    }
    return;
  }
  if (owner) {
    group_acc[tid] = acc[0];
    group_sum[tid] = sum;
  }
  __syncthreads();
  if (tid < head_dim) {
    float a = 0.f, l = 0.f;
    for (int g = 0; g < groups; ++g) {
      a += group_acc[g * head_dim + tid];
      l += group_sum[g * head_dim + tid];
    }
    store1(orow + tid, a / l);
  }
}

#define PAGED_DECODE(NAME, T)                                                                                         \
  extern "C" __global__ void __launch_bounds__(THREADS)                                                               \
      NAME(const T *q, const T *keys, const T *values, const uint32_t *tables, const uint32_t *lens, T *out, int heads, \
           int kv_heads, int head_dim, int width, int block, float scale, float softcap, int window, int vec16) {       \
    paged_decode<T>(q, keys, values, tables, lens, out, heads, kv_heads, head_dim, width, block, scale, softcap,       \
                    window, vec16);                                                                                   \
  }

PAGED_DECODE(paged_decode_f32, float)
PAGED_DECODE(paged_decode_bf16, __nv_bfloat16)
PAGED_DECODE(paged_decode_f16, __half)

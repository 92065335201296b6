// Attention forward for inference on x86 CPUs with AVX-512 BF16: softmax(q k^T / sqrt(D)) v per head,
// with q k^T and p v as bf16 dot products accumulated in fp32 (vdpbf16ps) and the softmax in fp32.
//
// Two layouts of the texts:
// - padded (tfm_attention_bf16): qkv (B, T, 3, H, D) bf16 (a fused projection's output), mask (B, T)
//   bytes, nonzero at keys to attend; out (B, T, H, D) bf16. Keys after a row's last real one and
//   query rows from there on are skipped: those rows of `out` are zero.
// - packed (tfm_attention_bf16_packed): the B texts end to end, text b being tokens
//   [offsets[b], offsets[b + 1]) of qkv (N, 3, H, D) and out (N, H, D); every token is real, and a
//   text attends to itself only. T is then the longest text.
// D is 16, 32 or 64. Threads take the (b, h) pairs one at a time from a shared counter, so that
// texts of unequal lengths still share the work evenly.
// transformer_cli/kernels.py compiles and loads it; tests/test_kernels.py checks it against the
// reference attention.
#include <immintrin.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define R 4  // query rows at a time: each packed key and value pair is loaded once for R rows

typedef struct {
  const uint16_t *qkv;
  const uint8_t *mask;     // padded layout; NULL in the packed one
  const int64_t *offsets;  // packed layout; NULL in the padded one
  uint16_t *out;
  int B, T, H, D;
  int *next;  // the next (b, h) pair to take, shared by the threads
  int status;
} job_t;

// exp(x) for x in [-87, 0]: 2^(x log2 e) as 2^n 2^f, 2^f by a degree-5 polynomial fitted for relative
// error on [-0.5, 0.5] (under 1.5e-7 before fp32 rounding; tests/test_kernels.py checks it)
static inline __m512 exp_ps(__m512 x) {
  __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(1.44269504f));
  __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_sub_ps(t, n);  // [-0.5, 0.5]
  __m512 p = _mm512_set1_ps(1.32669706e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.67545994e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.55074252e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40221217e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.93146944e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.00000012f));
  return _mm512_scalef_ps(p, n);
}

// One (batch row, head), with the calling thread's scratch: packed keys `kp` and values `vp`, R rows of
// scores `s` (fp32) and of probabilities `pb` (bf16), and a 16-key mask `km` per chunk of keys.
static inline __attribute__((always_inline)) void head(const job_t *j, int b, int h, uint16_t *kp, uint16_t *vp,
                                                       float *s, uint16_t *pb, __mmask16 *km, const int D) {
  const int T = j->T, H = j->H, C = H * D, NP = D / 2, NV = D / 16;
  const uint8_t *mrow = NULL;  // NULL: every key of the text is real
  size_t first;                // the text's first token
  int L;                       // keys [0, L) hold every real one
  if (j->offsets) {
    first = (size_t)j->offsets[b];
    L = (int)(j->offsets[b + 1] - j->offsets[b]);
  } else {
    first = (size_t)b * T;
    mrow = j->mask + first;
    L = T;
    while (L > 0 && !mrow[L - 1]) --L;
  }
  uint16_t *orow = j->out + first * C + (size_t)h * D;
  for (int i = L; i < T && mrow; ++i) memset(orow + (size_t)i * C, 0, D * sizeof(uint16_t));
  if (L == 0) return;
  const int NC = (L + 15) / 16, L16 = NC * 16;  // key chunks of 16
  const uint16_t *base = j->qkv + first * 3 * C + (size_t)h * D;  // q of token t at base + t * 3C
  const uint16_t *kbase = base + C, *vbase = base + 2 * C;
  // K as [chunk][pair of dims][16 keys] of 32-bit pairs; V as [pair of keys][D][2 keys]
  uint32_t *kp32 = (uint32_t *)kp;
  for (int c = 0; c < NC; ++c) {
    __mmask16 m = 0;
    for (int jj = 0; jj < 16; ++jj) {
      int t = c * 16 + jj;
      const uint32_t *krow = (const uint32_t *)(kbase + (size_t)t * 3 * C);
      if (t < L) {
        if (!mrow || mrow[t]) m |= (__mmask16)(1u << jj);
        for (int p = 0; p < NP; ++p) kp32[(c * NP + p) * 16 + jj] = krow[p];
      } else {
        for (int p = 0; p < NP; ++p) kp32[(c * NP + p) * 16 + jj] = 0;
      }
    }
    km[c] = m;
  }
  // interleave two keys' values: lanes (2d, 2d + 1) = (v[t][d], v[t + 1][d])
  const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37,
                                      5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  for (int t = 0; t < L16; t += 2) {
    for (int v = 0; v < NV; ++v) {
      __m512i a = _mm512_setzero_si512(), c2 = _mm512_setzero_si512();
      if (t < L) a = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(vbase + (size_t)t * 3 * C + 16 * v)));
      if (t + 1 < L)
        c2 = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(vbase + (size_t)(t + 1) * 3 * C + 16 * v)));
      _mm512_storeu_si512(vp + ((size_t)(t / 2) * D + 16 * v) * 2, _mm512_permutex2var_epi16(a, lo, c2));
    }
  }
  const float scale = 1.0f / sqrtf((float)D);
  const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
  for (int i0 = 0; i0 < L; i0 += R) {
    const int nr = L - i0 < R ? L - i0 : R;
    const uint32_t *q32[R];
    for (int r = 0; r < R; ++r) q32[r] = (const uint32_t *)(base + (size_t)(i0 + (r < nr ? r : 0)) * 3 * C);
    __m512 mx[R];
    for (int r = 0; r < R; ++r) mx[r] = ninf;
    for (int c = 0; c < NC; ++c) {
      __m512 acc0[R], acc1[R];  // two sums per row (even and odd pairs of dims): twice the chains in flight
      for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm512_setzero_ps();
      for (int p = 0; p < NP; p += 2) {
        __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp32 + (c * NP + p) * 16);
        __m512bh k1 = (__m512bh)_mm512_loadu_si512(kp32 + (c * NP + p + 1) * 16);
        for (int r = 0; r < R; ++r) {
          acc0[r] = _mm512_dpbf16_ps(acc0[r], (__m512bh)_mm512_set1_epi32((int)q32[r][p]), k0);
          acc1[r] = _mm512_dpbf16_ps(acc1[r], (__m512bh)_mm512_set1_epi32((int)q32[r][p + 1]), k1);
        }
      }
      for (int r = 0; r < R; ++r) {
        __m512 sc = _mm512_mask_mul_ps(ninf, km[c], _mm512_add_ps(acc0[r], acc1[r]), vscale);
        mx[r] = _mm512_max_ps(mx[r], sc);
        _mm512_storeu_ps(s + r * L16 + c * 16, sc);
      }
    }
    float inv[R];
    for (int r = 0; r < R; ++r) {
      const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx[r]));
      __m512 sum = _mm512_setzero_ps();
      for (int c = 0; c < NC; c += 2) {
        __m512 e0 = _mm512_maskz_mov_ps(km[c], exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + r * L16 + c * 16), m)));
        __m512 e1 = _mm512_setzero_ps();
        if (c + 1 < NC)
          e1 = _mm512_maskz_mov_ps(km[c + 1], exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + r * L16 + (c + 1) * 16), m)));
        sum = _mm512_add_ps(sum, _mm512_add_ps(e0, e1));
        _mm512_storeu_si512(pb + r * (L16 + 16) + c * 16, (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
      }
      inv[r] = 1.0f / _mm512_reduce_add_ps(sum);
    }
    // p v: for D <= 32 (one or two 16-lane sums per row), two sums each (even and odd key pairs) to keep
    // enough independent vdpbf16ps chains in flight
    const int NS = NV <= 2 ? 2 : 1;
    __m512 o[2][R][4];
    for (int k = 0; k < NS; ++k)
      for (int r = 0; r < R; ++r)
        for (int v = 0; v < NV; ++v) o[k][r][v] = _mm512_setzero_ps();
    const uint32_t *p32[R];
    for (int r = 0; r < R; ++r) p32[r] = (const uint32_t *)(pb + r * (L16 + 16));
    for (int jp = 0; jp < L16 / 2; jp += NS) {
      for (int k = 0; k < NS; ++k)
        for (int v = 0; v < NV; ++v) {
          __m512bh vv = (__m512bh)_mm512_loadu_si512(vp + ((size_t)(jp + k) * D + 16 * v) * 2);
          for (int r = 0; r < R; ++r)
            o[k][r][v] = _mm512_dpbf16_ps(o[k][r][v], (__m512bh)_mm512_set1_epi32((int)p32[r][jp + k]), vv);
        }
    }
    for (int r = 0; r < nr; ++r)
      for (int v = 0; v < NV; ++v) {
        __m512 sum = NS == 2 ? _mm512_add_ps(o[0][r][v], o[1][r][v]) : o[0][r][v];
        _mm256_storeu_si256((__m256i *)(orow + (size_t)(i0 + r) * C + 16 * v),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(sum, _mm512_set1_ps(inv[r]))));
      }
  }
}

static void *alloc64(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

static void *run(void *arg) {
  job_t *j = (job_t *)arg;
  const size_t T16 = (size_t)(j->T + 15) / 16 * 16 + 16, D = (size_t)j->D;
  uint16_t *kp = alloc64(T16 * D * 2), *vp = alloc64(T16 * D * 2), *pb = alloc64(R * (T16 + 16) * 2);
  float *s = alloc64(R * T16 * 4);
  __mmask16 *km = alloc64((T16 / 16) * sizeof(__mmask16));
  if (!kp || !vp || !s || !pb || !km) {
    j->status = 1;
  } else {
    const int n = j->B * j->H;
    for (int bh; (bh = __atomic_fetch_add(j->next, 1, __ATOMIC_RELAXED)) < n;) {  // D as a constant: each head
      const int b = bh / j->H, h = bh % j->H;                                     // size its own unrolled code
      if (j->D == 16)
        head(j, b, h, kp, vp, s, pb, km, 16);
      else if (j->D == 32)
        head(j, b, h, kp, vp, s, pb, km, 32);
      else
        head(j, b, h, kp, vp, s, pb, km, 64);
    }
  }
  free(kp);
  free(vp);
  free(s);
  free(pb);
  free(km);
  return NULL;
}

static int launch(const uint16_t *qkv, const uint8_t *mask, const int64_t *offsets, uint16_t *out, int B, int T,
                  int H, int D, int threads) {
  if (D != 16 && D != 32 && D != 64) return 2;
  const int n = B * H;
  if (threads > n) threads = n;
  if (threads > 64) threads = 64;
  if (threads < 1) threads = 1;
  int next = 0;
  job_t jobs[64];
  pthread_t tid[64];
  int started[64] = {0};
  for (int k = 0; k < threads; ++k) jobs[k] = (job_t){qkv, mask, offsets, out, B, T, H, D, &next, 0};
  for (int k = 1; k < threads; ++k) started[k] = pthread_create(&tid[k], NULL, run, &jobs[k]) == 0;
  run(&jobs[0]);
  int status = jobs[0].status;
  for (int k = 1; k < threads; ++k) {
    if (started[k]) pthread_join(tid[k], NULL);  // a share with no thread of its own was taken by the others
    status |= jobs[k].status;
  }
  return status;
}

// Both return 0; 1 when scratch memory could not be had (`out` is then incomplete); 2 for an unsupported D.
int tfm_attention_bf16(const uint16_t *qkv, const uint8_t *mask, uint16_t *out, int B, int T, int H, int D,
                       int threads) {
  return launch(qkv, mask, NULL, out, B, T, H, D, threads);
}

int tfm_attention_bf16_packed(const uint16_t *qkv, const int64_t *offsets, uint16_t *out, int B, int longest, int H,
                              int D, int threads) {
  return launch(qkv, NULL, offsets, out, B, longest, H, D, threads);
}

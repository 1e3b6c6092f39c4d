// The memory limit an fp32 AdamW step is judged against, compiled apart.
//
// Shares no code with the Grace Adam kernel: experiments/stream_limit.py
// compiles this file on the machine that runs the benchmark, with the
// compiler's own vectorisation, and reads its time as the limit. Each pass
// moves the bytes of one in-place AdamW step, 28 per element (reads master,
// grad, mu and nu; writes master, mu and nu), with no Adam math:
//   master += grad; (mu, nu) = (nu, mu).
// Variants differ only in how they stream, so the fastest one is the limit:
//   0 plain  no software prefetch, ordinary stores
//   1 t0     prefetch 1 KiB ahead into all cache levels (locality 3)
//   2 nta    prefetch 1 KiB ahead, non-temporal (locality 0)
//   3 ntst   no software prefetch, non-temporal (streaming) stores
// With low-precision moments (2 or 1 bytes each, bf16 or 8-bit) the moment
// streams move that many bytes per element: 20 or 16 bytes per element.

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#endif

enum { kLine = 16, kAheadLines = 16 };  // 16 floats = 64 B; 1 KiB ahead.

typedef struct {
  float* master;
  float* grad;
  float* mu;
  float* nu;
  int64_t n;
} Streams;

typedef struct {
  const Streams* s;
  int64_t begin, end;
  int variant;
  int moment_bytes;  // 4, 2 or 1.
} Part;

// One 64-byte line: GCC/Clang lower this vector type to whatever the target
// has (one AVX-512 register, two AVX2 ones, four NEON ones).
typedef float Line __attribute__((vector_size(64), aligned(64)));

// One line of each stream (the streams are 64-byte aligned).
static inline void MoveLine(float* master, const float* grad, float* mu,
                            float* nu) {
  const Line m = *(const Line*)mu;
  *(Line*)master = *(const Line*)master + *(const Line*)grad;
  *(Line*)mu = *(const Line*)nu;
  *(Line*)nu = m;
}

static inline void MoveLineStreaming(float* master, const float* grad,
                                     float* mu, float* nu) {
#if defined(__AVX512F__)
  const __m512 m = _mm512_load_ps(mu);
  _mm512_stream_ps(master,
                   _mm512_add_ps(_mm512_load_ps(master), _mm512_load_ps(grad)));
  _mm512_stream_ps(mu, _mm512_load_ps(nu));
  _mm512_stream_ps(nu, m);
#elif defined(__AVX__)
  for (int j = 0; j < kLine; j += 8) {
    const __m256 m = _mm256_load_ps(mu + j);
    _mm256_stream_ps(master + j, _mm256_add_ps(_mm256_load_ps(master + j),
                                               _mm256_load_ps(grad + j)));
    _mm256_stream_ps(mu + j, _mm256_load_ps(nu + j));
    _mm256_stream_ps(nu + j, m);
  }
#else
  MoveLine(master, grad, mu, nu);
#endif
}

static inline void StoreLine(float* dst, Line value, int streaming) {
#if defined(__AVX512F__)
  if (streaming) {
    _mm512_stream_ps(dst, (__m512)value);
    return;
  }
#elif defined(__AVX__)
  if (streaming) {
    __m256 half[2];
    memcpy(half, &value, sizeof(half));
    _mm256_stream_ps(dst, half[0]);
    _mm256_stream_ps(dst + 8, half[1]);
    return;
  }
#endif
  *(Line*)dst = value;
}

// Elements per step of the narrow-moment loop: 4 lines of master and grad,
// `moment_bytes` lines of each moment.
enum { kNarrowStep = 4 * kLine };

static inline void Prefetch(const void* p, int variant) {
  if (variant == 1) __builtin_prefetch(p, 1, 3);
  if (variant == 2) __builtin_prefetch(p, 1, 0);
}

// A pass with moments of p->moment_bytes (< 4) per element: the same
// master += grad, and the moments' bytes swapped line by line.
static void RunNarrowPart(const Part* p) {
  const Streams* s = p->s;
  const int64_t w = p->moment_bytes;
  char* mu = (char*)s->mu;
  char* nu = (char*)s->nu;
  const int64_t ahead = kAheadLines * kLine;
  for (int64_t i = p->begin; i < p->end; i += kNarrowStep) {
    for (int64_t j = 0; j < kNarrowStep; j += kLine) {
      Prefetch(s->master + i + j + ahead, p->variant);
      Prefetch(s->grad + i + j + ahead, p->variant);
    }
    for (int64_t b = 0; b < w * kNarrowStep; b += 64) {
      Prefetch(mu + (i + ahead) * w + b, p->variant);
      Prefetch(nu + (i + ahead) * w + b, p->variant);
    }
    const int streaming = p->variant == 3;
    for (int64_t j = 0; j < kNarrowStep; j += kLine) {
      float* master = s->master + i + j;
      StoreLine(master, *(const Line*)master + *(const Line*)(s->grad + i + j),
                streaming);
    }
    for (int64_t b = 0; b < w * kNarrowStep; b += 64) {
      float* m = (float*)(mu + i * w + b);
      float* v = (float*)(nu + i * w + b);
      const Line old = *(const Line*)m;
      StoreLine(m, *(const Line*)v, streaming);
      StoreLine(v, old, streaming);
    }
  }
}

static void* RunPart(void* arg) {
  const Part* p = (const Part*)arg;
  if (p->moment_bytes != 4) {
    RunNarrowPart(p);
#if defined(__AVX__)
    if (p->variant == 3) _mm_sfence();
#endif
    return NULL;
  }
  const Streams* s = p->s;
  const int64_t ahead = kAheadLines * kLine;
  for (int64_t i = p->begin; i < p->end; i += kLine) {
    if (p->variant == 1) {
      __builtin_prefetch(s->master + i + ahead, 1, 3);
      __builtin_prefetch(s->mu + i + ahead, 1, 3);
      __builtin_prefetch(s->nu + i + ahead, 1, 3);
      __builtin_prefetch(s->grad + i + ahead, 0, 3);
    } else if (p->variant == 2) {
      __builtin_prefetch(s->master + i + ahead, 1, 0);
      __builtin_prefetch(s->mu + i + ahead, 1, 0);
      __builtin_prefetch(s->nu + i + ahead, 1, 0);
      __builtin_prefetch(s->grad + i + ahead, 0, 0);
    }
    if (p->variant == 3) {
      MoveLineStreaming(s->master + i, s->grad + i, s->mu + i, s->nu + i);
    } else {
      MoveLine(s->master + i, s->grad + i, s->mu + i, s->nu + i);
    }
  }
#if defined(__AVX__)
  if (p->variant == 3) _mm_sfence();
#endif
  return NULL;
}

// Whether this build has the streaming-store variant.
int stream_limit_has_streaming_stores(void) {
#if defined(__AVX512F__) || defined(__AVX__)
  return 1;
#else
  return 0;
#endif
}

void stream_limit_free(Streams* s);

// Allocates four 64-byte aligned streams of n floats (n a multiple of 16),
// touched once so that no pass pays for page faults. NULL on failure.
Streams* stream_limit_alloc(int64_t n) {
  if (n <= 0 || n % kLine != 0) return NULL;
  Streams* s = (Streams*)calloc(1, sizeof(Streams));
  if (s == NULL) return NULL;
  s->n = n;
  float** fields[4] = {&s->master, &s->grad, &s->mu, &s->nu};
  for (int k = 0; k < 4; ++k) {
    *fields[k] = (float*)aligned_alloc(64, (size_t)n * sizeof(float));
    if (*fields[k] == NULL) {
      stream_limit_free(s);
      return NULL;
    }
    for (int64_t i = 0; i < n; ++i) (*fields[k])[i] = 1e-3f * (float)(k + 1);
  }
  return s;
}

void stream_limit_free(Streams* s) {
  if (s == NULL) return;
  free(s->master);
  free(s->grad);
  free(s->mu);
  free(s->nu);
  free(s);
}

// Stream k (0 master, 1 grad, 2 mu, 3 nu), for tests to fill and check.
float* stream_limit_stream(Streams* s, int k) {
  if (s == NULL || k < 0 || k > 3) return NULL;
  float* fields[4] = {s->master, s->grad, s->mu, s->nu};
  return fields[k];
}

// One pass of `variant` over all elements on `threads` threads, each taking
// one contiguous, line-aligned part, with moments of `moment_bytes` per
// element. Returns 0, or -1 on bad arguments.
// With moment_bytes 2 or 1, n must be a multiple of kNarrowStep (64).
int stream_limit_pass(Streams* s, int variant, int threads, int moment_bytes) {
  if (s == NULL || variant < 0 || variant > 3 || threads < 1 || threads > 256 ||
      (moment_bytes != 4 && moment_bytes != 2 && moment_bytes != 1) ||
      (moment_bytes != 4 && s->n % kNarrowStep != 0)) {
    return -1;
  }
  pthread_t ids[256];
  Part parts[256];
  const int64_t unit = moment_bytes == 4 ? kLine : kNarrowStep;
  const int64_t units = s->n / unit;
  for (int t = 0; t < threads; ++t) {
    parts[t].s = s;
    parts[t].variant = variant;
    parts[t].moment_bytes = moment_bytes;
    parts[t].begin = units * t / threads * unit;
    parts[t].end = units * (t + 1) / threads * unit;
  }
  int started = 1;
  while (started < threads &&
         pthread_create(&ids[started], NULL, RunPart, &parts[started]) == 0) {
    ++started;
  }
  if (started == threads) RunPart(&parts[0]);
  for (int t = 1; t < started; ++t) pthread_join(ids[t], NULL);
  return started == threads ? 0 : -1;
}

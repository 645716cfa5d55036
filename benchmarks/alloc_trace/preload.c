/* An LD_PRELOAD allocation log for benchmarks/alloc_trace.py.
 *
 * Why: the CPU meter (memcc/backend/memory.py) sees one number, the resident high-water mark
 * of a step; when it is above the prediction, this log says which allocations make the
 * difference. Every malloc family call made while armed is appended to an in-memory array
 * (pointer, bytes as the measurement counts them, the caller's frames for buffers of 4 KiB
 * or more); free calls are appended with negative bytes. Nothing is printed until
 * ``trace_dump`` writes the array out, so the step runs without I/O.
 *
 * Build: cc -O2 -shared -fPIC -o preload.so preload.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <malloc.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#define MAX_EVENTS 4000000
#define FRAMES 6
#define MMAP_BYTES 4096 /* the meter's MALLOC_MMAP_THRESHOLD_ */

typedef struct { void *p; long long bytes; void *frames[FRAMES]; } Event;

static void *(*real_malloc)(size_t);
static void (*real_free)(void *);
static void *(*real_calloc)(size_t, size_t);
static void *(*real_realloc)(void *, size_t);
static int (*real_posix_memalign)(void **, size_t, size_t);
static void *(*real_aligned_alloc)(size_t, size_t);
static void *(*real_memalign)(size_t, size_t);

/* dlsym itself allocates before the real functions are known: serve it from here. */
static char boot[1 << 16];
static size_t boot_used;
static volatile int lock_word;
static int armed;
static __thread int in_backtrace;
static Event *events;
static long n_events;

static void lock(void) { while (__sync_lock_test_and_set(&lock_word, 1)) {} }
static void unlock(void) { __sync_lock_release(&lock_word); }

static void find_real(void) {
  if (real_malloc) return;
  real_malloc = dlsym(RTLD_NEXT, "malloc");
  real_free = dlsym(RTLD_NEXT, "free");
  real_calloc = dlsym(RTLD_NEXT, "calloc");
  real_realloc = dlsym(RTLD_NEXT, "realloc");
  real_posix_memalign = dlsym(RTLD_NEXT, "posix_memalign");
  real_aligned_alloc = dlsym(RTLD_NEXT, "aligned_alloc");
  real_memalign = dlsym(RTLD_NEXT, "memalign");
}

static void *from_boot(size_t n) {
  void *p = boot + boot_used;
  boot_used += (n + 15) & ~(size_t)15;
  return p;
}

static int is_boot(void *p) { return (char *)p >= boot && (char *)p < boot + sizeof boot; }

/* Bytes as the meter sees them: a buffer of a page or more is its own mmap (size and a
 * 16-byte header, rounded up to pages); a smaller one is heap bytes plus its 8-byte header. */
static long long counted(void *p) {
  size_t usable = malloc_usable_size(p);
  if (usable + 8 >= MMAP_BYTES) return (long long)((usable + 16 + MMAP_BYTES - 1) / MMAP_BYTES) * MMAP_BYTES;
  return (long long)usable + 8;
}

static void record(void *p, int freed) {
  if (!p || !armed || in_backtrace) return;
  long long bytes = counted(p);
  void *frames[FRAMES + 2] = {0};
  if (!freed && bytes >= MMAP_BYTES) {
    in_backtrace = 1;
    backtrace(frames, FRAMES + 2);
    in_backtrace = 0;
  }
  lock();
  if (n_events < MAX_EVENTS) {
    Event *e = &events[n_events++];
    e->p = p;
    e->bytes = freed ? -bytes : bytes;
    memcpy(e->frames, frames + 2, sizeof e->frames);
  }
  unlock();
}

void *malloc(size_t n) {
  find_real();
  if (!real_malloc) return from_boot(n);
  void *p = real_malloc(n);
  record(p, 0);
  return p;
}

void *calloc(size_t a, size_t b) {
  if (!real_calloc) { void *p = from_boot(a * b); memset(p, 0, a * b); return p; }
  void *p = real_calloc(a, b);
  record(p, 0);
  return p;
}

void free(void *p) {
  if (!p || is_boot(p)) return;
  record(p, 1);
  real_free(p);
}

void *realloc(void *p, size_t n) {
  if (is_boot(p)) { void *q = malloc(n); memcpy(q, p, n); return q; }
  if (p) record(p, 1);
  void *q = real_realloc(p, n);
  if (q) record(q, 0);
  return q;
}

int posix_memalign(void **out, size_t align, size_t n) {
  find_real();
  int rc = real_posix_memalign(out, align, n);
  if (!rc) record(*out, 0);
  return rc;
}

void *aligned_alloc(size_t align, size_t n) {
  find_real();
  void *p = real_aligned_alloc(align, n);
  record(p, 0);
  return p;
}

void *memalign(size_t align, size_t n) {
  find_real();
  void *p = real_memalign(align, n);
  record(p, 0);
  return p;
}

/* Start logging (the first call takes the log's memory and loads the unwinder). */
void trace_arm(void) {
  find_real();
  if (!events) {
    void *frames[4];
    in_backtrace = 1;
    events = real_malloc(sizeof(Event) * MAX_EVENTS);
    backtrace(frames, 4);
    in_backtrace = 0;
  }
  lock();
  armed = 1;
  unlock();
}

/* A marker in the log: a null pointer with zero bytes, its tag in the first frame. */
void trace_mark(long tag) {
  lock();
  if (n_events < MAX_EVENTS) {
    Event *e = &events[n_events++];
    memset(e, 0, sizeof *e);
    e->frames[0] = (void *)tag;
  }
  unlock();
}

/* One line per event: pointer, bytes, then library:symbol+offset of each caller frame. */
void trace_dump(const char *path) {
  int was = armed;
  armed = 0;
  FILE *f = fopen(path, "w");
  for (long i = 0; f && i < n_events; i++) {
    Event *e = &events[i];
    fprintf(f, "%lx %lld", (unsigned long)e->p, e->bytes);
    if (!e->p) fprintf(f, " mark:%ld", (long)e->frames[0]);
    for (int j = 0; e->p && e->bytes > 0 && j < FRAMES && e->frames[j]; j++) {
      Dl_info d;
      if (!dladdr(e->frames[j], &d) || !d.dli_fname) continue;
      const char *lib = strrchr(d.dli_fname, '/');
      char *base = d.dli_saddr ? (char *)d.dli_saddr : (char *)d.dli_fbase;
      fprintf(f, " %s:%s+%lx", lib ? lib + 1 : d.dli_fname, d.dli_sname ? d.dli_sname : "?",
              (unsigned long)((char *)e->frames[j] - base));
    }
    fprintf(f, "\n");
  }
  if (f) fclose(f);
  armed = was;
}

/* The floor under a device-clock span: what the CUDA driver's own calls cost the host thread that
 * makes them, from C, with nothing of Python or torch around them (bench/gpu_span_floor.sh builds
 * and runs it).
 *
 * A span on the device clock records two events on the work's stream (its start and its end); the
 * collector's target is 1 us of training-thread time a span. This measures, per call, on one
 * thread: cuEventRecord of a timing event on the default stream and on a stream of its own,
 * cuEventQuery of a completed event, and the bare loop. Events come from a pool, re-recorded in
 * turn as the collector's are; the stream is idle (a record on a busy stream costs no more host
 * time: it only enqueues).
 *
 * No CUDA headers: the few driver entry points are declared here and looked up in libcuda at run
 * time, so it builds with any C compiler.
 *
 *   cc -O2 -o event_floor bench/gpu_event_floor.c -ldl && ./event_floor 200000
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUevent;
typedef void *CUstream;

#define POOL 1024

static CUresult (*cuInit)(unsigned);
static CUresult (*cuDeviceGet)(CUdevice *, int);
static CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
static CUresult (*cuCtxSetCurrent)(CUcontext);
static CUresult (*cuEventCreate)(CUevent *, unsigned);
static CUresult (*cuEventRecord)(CUevent, CUstream);
static CUresult (*cuEventQuery)(CUevent);
static CUresult (*cuEventSynchronize)(CUevent);
static CUresult (*cuStreamCreate)(CUstream *, unsigned);

static void *need(void *lib, const char *name) {
    void *f = dlsym(lib, name);
    if (!f) {
        fprintf(stderr, "event_floor: libcuda has no %s\n", name);
        exit(2);
    }
    return f;
}

static void check(CUresult r, const char *what) {
    if (r != 0) {
        fprintf(stderr, "event_floor: %s failed (CUresult %d)\n", what, r);
        exit(2);
    }
}

static double now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return (double)t.tv_sec * 1e9 + (double)t.tv_nsec;
}

static volatile int sink;

/* ns of this thread's CPU per call: the median of five runs of n calls. */
static double per_call(int what, CUevent *pool, CUstream stream, long n) {
    double runs[5];
    for (int r = 0; r < 5; r++) {
        double t0 = now_ns();
        for (long i = 0; i < n; i++) {
            CUevent ev = pool[i % POOL];
            if (what == 0) {
                sink += (int)(i & 1);
            } else if (what == 1) {
                cuEventRecord(ev, stream);
            } else {
                sink += cuEventQuery(ev);
            }
        }
        runs[r] = (now_ns() - t0) / (double)n;
        cuEventSynchronize(pool[(n - 1) % POOL]);
    }
    for (int i = 0; i < 5; i++)
        for (int j = i + 1; j < 5; j++)
            if (runs[j] < runs[i]) {
                double t = runs[i];
                runs[i] = runs[j];
                runs[j] = t;
            }
    return runs[2];
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 200000;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) {
        fprintf(stderr, "event_floor: no libcuda.so.1 (%s)\n", dlerror());
        return 2;
    }
    cuInit = need(lib, "cuInit");
    cuDeviceGet = need(lib, "cuDeviceGet");
    cuDevicePrimaryCtxRetain = need(lib, "cuDevicePrimaryCtxRetain");
    cuCtxSetCurrent = need(lib, "cuCtxSetCurrent");
    cuEventCreate = need(lib, "cuEventCreate");
    cuEventRecord = need(lib, "cuEventRecord");
    cuEventQuery = need(lib, "cuEventQuery");
    cuEventSynchronize = need(lib, "cuEventSynchronize");
    cuStreamCreate = need(lib, "cuStreamCreate");
    CUdevice dev;
    CUcontext ctx;
    CUstream own;
    check(cuInit(0), "cuInit");
    check(cuDeviceGet(&dev, 0), "cuDeviceGet");
    check(cuDevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain");
    check(cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
    check(cuStreamCreate(&own, 1 /* non-blocking */), "cuStreamCreate");
    CUevent pool[POOL];
    for (int i = 0; i < POOL; i++)
        check(cuEventCreate(&pool[i], 0 /* default: timing enabled */), "cuEventCreate");
    for (int i = 0; i < POOL; i++) /* every event recorded once before timing */
        check(cuEventRecord(pool[i], own), "cuEventRecord");
    check(cuEventSynchronize(pool[POOL - 1]), "cuEventSynchronize");
    double loop = per_call(0, pool, own, n);
    double rec_default = per_call(1, pool, NULL, n);
    double rec_own = per_call(1, pool, own, n);
    double query = per_call(2, pool, own, n);
    printf("what\tns per call (thread CPU, median of 5 x %ld)\n", n);
    printf("bare loop\t%.1f\n", loop);
    printf("cuEventRecord, default stream\t%.1f\n", rec_default - loop);
    printf("cuEventRecord, a stream of its own\t%.1f\n", rec_own - loop);
    printf("cuEventQuery, a completed event\t%.1f\n", query - loop);
    printf("two records (a span's start and end), own stream\t%.1f\n", 2 * (rec_own - loop));
    return 0;
}

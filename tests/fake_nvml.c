/* A stand-in for libnvidia-ml.so.1, loaded by the real pynvml binding in the tests.
 *
 * It reads a script from the file named by $FAKE_NVML_CONFIG at every nvmlInitWithFlags:
 *   devices N                 number of GPUs
 *   name TEXT / memory_mb N / driver TEXT / cc MAJOR MINOR
 *   util DEV PERCENT          nvmlDeviceGetUtilizationRates(DEV).gpu
 *   procfile DEV PATH PERCENT every pid listed in PATH (re-read at each call) uses PERCENT SM on DEV
 *   fail_after N              utilisation calls after the first N fail with NVML_ERROR_UNKNOWN
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define OK 0
#define NOT_SUPPORTED 3
#define INVALID_ARGUMENT 2
#define NOT_FOUND 6
#define INSUFFICIENT_SIZE 7
#define UNKNOWN 999
#define MAXDEV 8

typedef struct { unsigned long long total, free, used; } mem_t;
typedef struct { unsigned int gpu, memory; } util_t;
typedef struct { unsigned int pid; unsigned long long ts; unsigned int sm, mem, enc, dec; } sample_t;

static int ndev = 0, major = 9, minor = 0, fail_after = -1, calls = 0;
static unsigned long long memory_mb = 81559;
static char name[96] = "NVIDIA Stand-in", driver[32] = "550.0";
static unsigned int util[MAXDEV];
static char procfile[MAXDEV][256];
static unsigned int procutil[MAXDEV];

int nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    const char *path = getenv("FAKE_NVML_CONFIG");
    FILE *f = path ? fopen(path, "r") : NULL;
    if (!f) return UNKNOWN;
    char line[512];
    memset(procfile, 0, sizeof procfile);
    memset(util, 0, sizeof util);
    calls = 0;
    fail_after = -1;
    while (fgets(line, sizeof line, f)) {
        int d, p; char text[256];
        line[strcspn(line, "\n")] = 0;
        if (sscanf(line, "devices %d", &ndev) == 1) continue;
        if (strncmp(line, "name ", 5) == 0) { snprintf(name, sizeof name, "%.95s", line + 5); continue; }
        if (sscanf(line, "memory_mb %llu", &memory_mb) == 1) continue;
        if (sscanf(line, "driver %31s", driver) == 1) continue;
        if (sscanf(line, "cc %d %d", &major, &minor) == 2) continue;
        if (sscanf(line, "util %d %d", &d, &p) == 2 && d >= 0 && d < MAXDEV) { util[d] = p; continue; }
        if (sscanf(line, "procfile %d %255s %d", &d, text, &p) == 3 && d >= 0 && d < MAXDEV) {
            snprintf(procfile[d], sizeof procfile[d], "%s", text); procutil[d] = p; continue;
        }
        if (sscanf(line, "fail_after %d", &fail_after) == 1) continue;
    }
    fclose(f);
    return OK;
}
int nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
int nvmlShutdown(void) { return OK; }
const char *nvmlErrorString(int r) { return r == NOT_SUPPORTED ? "Not Supported" : r == NOT_FOUND ? "Not Found" : "Unknown Error"; }

static int dev(void *h) { long i = (long)h - 1; return (i >= 0 && i < ndev) ? (int)i : -1; }
static int failing(void) { return fail_after >= 0 && calls++ >= fail_after; }

int nvmlDeviceGetCount_v2(unsigned int *n) { *n = ndev; return OK; }
int nvmlDeviceGetHandleByIndex_v2(unsigned int i, void **h) {
    if ((int)i >= ndev) return INVALID_ARGUMENT;
    *h = (void *)(long)(i + 1); return OK;
}
int nvmlSystemGetDriverVersion(char *buf, unsigned int len) { snprintf(buf, len, "%s", driver); return OK; }
int nvmlDeviceGetName(void *h, char *buf, unsigned int len) {
    if (dev(h) < 0) return INVALID_ARGUMENT;
    snprintf(buf, len, "%s", name); return OK;
}
int nvmlDeviceGetUUID(void *h, char *buf, unsigned int len) {
    if (dev(h) < 0) return INVALID_ARGUMENT;
    snprintf(buf, len, "GPU-00000000-0000-0000-0000-%012d", dev(h)); return OK;
}
int nvmlDeviceGetMemoryInfo(void *h, mem_t *m) {
    if (dev(h) < 0) return INVALID_ARGUMENT;
    m->total = memory_mb * 1024 * 1024; m->free = m->total; m->used = 0; return OK;
}
int nvmlDeviceGetCudaComputeCapability(void *h, int *ma, int *mi) {
    if (dev(h) < 0) return INVALID_ARGUMENT;
    *ma = major; *mi = minor; return OK;
}
int nvmlDeviceGetMigMode(void *h, unsigned int *cur, unsigned int *pending) {
    (void)h; (void)cur; (void)pending; return NOT_SUPPORTED;
}
int nvmlDeviceGetUtilizationRates(void *h, util_t *u) {
    int d = dev(h);
    if (d < 0) return INVALID_ARGUMENT;
    if (failing()) return UNKNOWN;
    u->gpu = util[d]; u->memory = 0; return OK;
}
int nvmlDeviceGetProcessUtilization(void *h, sample_t *s, unsigned int *count, unsigned long long since) {
    int d = dev(h);
    (void)since;
    if (d < 0) return INVALID_ARGUMENT;
    if (failing()) return UNKNOWN;
    unsigned int pids[64], n = 0;
    FILE *f = procfile[d][0] ? fopen(procfile[d], "r") : NULL;
    if (f) { while (n < 64 && fscanf(f, "%u", &pids[n]) == 1) n++; fclose(f); }
    if (n == 0) { *count = 0; return NOT_FOUND; }
    if (s == NULL || *count < n) { *count = n; return INSUFFICIENT_SIZE; }
    for (unsigned int i = 0; i < n; i++) {
        s[i].pid = pids[i]; s[i].ts = since + 1; s[i].sm = procutil[d];
        s[i].mem = s[i].enc = s[i].dec = 0;
    }
    *count = n; return OK;
}

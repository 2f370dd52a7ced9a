/* A stand-in for libnvidia-ml.so.1, loaded by the real pynvml binding in the tests.
 *
 * It reads a script from the file named by $FAKE_NVML_CONFIG at every nvmlInitWithFlags:
 *   devices N                 number of GPUs
 *   name TEXT / memory_mb N / driver TEXT / cc MAJOR MINOR
 *   util DEV PERCENT          nvmlDeviceGetUtilizationRates(DEV).gpu
 *   procfile DEV PATH PERCENT every pid listed in PATH (re-read at each call) is a compute process
 *                             of DEV and uses PERCENT SM on it (its process utilisation)
 *   graphicsfile DEV PATH PERCENT  every pid listed in PATH is a graphics process of DEV, using
 *                             PERCENT SM on it (0: idle, absent from its process utilisation)
 *   temperature DEV C         DEV's temperature (default 40)
 *   power DEV MW              DEV's power limit as the owner left it (default 300000; allowed
 *                             100000..400000, default limit 350000)
 *   powerlog PATH             every power-limit call appends "DEV MW" to PATH, and the limit
 *                             read back is the last one set there: it outlives the process,
 *                             as a real GPU's does
 *   fail_after N              utilisation calls after the first N fail with NVML_ERROR_UNKNOWN
 *
 * The script is read again whenever the file is replaced or changed (a test changes a
 * temperature by writing a new script), so that the calls after see the new values.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

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
static char graphicsfile[MAXDEV][256];
static unsigned int graphicsutil[MAXDEV];
static unsigned int temperature[MAXDEV];
static unsigned int power[MAXDEV];
static char powerlog[256];
static struct stat seen;

static int load(void) {
    const char *path = getenv("FAKE_NVML_CONFIG");
    FILE *f = path ? fopen(path, "r") : NULL;
    if (!f) return UNKNOWN;
    fstat(fileno(f), &seen);
    char line[512];
    memset(procfile, 0, sizeof procfile);
    memset(graphicsfile, 0, sizeof graphicsfile);
    memset(util, 0, sizeof util);
    powerlog[0] = 0;
    for (int i = 0; i < MAXDEV; i++) { temperature[i] = 40; power[i] = 300000; }
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
        if (sscanf(line, "graphicsfile %d %255s %d", &d, text, &p) == 3 && d >= 0 && d < MAXDEV) {
            snprintf(graphicsfile[d], sizeof graphicsfile[d], "%s", text); graphicsutil[d] = p; continue;
        }
        if (sscanf(line, "temperature %d %d", &d, &p) == 2 && d >= 0 && d < MAXDEV) { temperature[d] = p; continue; }
        if (sscanf(line, "power %d %d", &d, &p) == 2 && d >= 0 && d < MAXDEV) { power[d] = p; continue; }
        if (sscanf(line, "powerlog %255s", text) == 1) { snprintf(powerlog, sizeof powerlog, "%s", text); continue; }
        if (sscanf(line, "fail_after %d", &fail_after) == 1) continue;
    }
    fclose(f);
    return OK;
}

/* The script again if it was replaced or changed since it was read. */
static void reload(void) {
    const char *path = getenv("FAKE_NVML_CONFIG");
    struct stat now;
    if (!path || stat(path, &now) != 0) return;
    if (now.st_ino != seen.st_ino || now.st_mtim.tv_sec != seen.st_mtim.tv_sec
        || now.st_mtim.tv_nsec != seen.st_mtim.tv_nsec || now.st_size != seen.st_size)
        load();
}

int nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    calls = 0;
    return load();
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
    if (d < 0) return INVALID_ARGUMENT;
    if (failing()) return UNKNOWN;
    reload();
    unsigned int pids[128], util_of[128], n = 0;
    FILE *f = procfile[d][0] ? fopen(procfile[d], "r") : NULL;
    if (f) { while (n < 64 && fscanf(f, "%u", &pids[n]) == 1) util_of[n++] = procutil[d]; fclose(f); }
    f = graphicsfile[d][0] && graphicsutil[d] ? fopen(graphicsfile[d], "r") : NULL;
    if (f) { while (n < 128 && fscanf(f, "%u", &pids[n]) == 1) util_of[n++] = graphicsutil[d]; fclose(f); }
    if (n == 0) { *count = 0; return NOT_FOUND; }
    if (s == NULL || *count < n) { *count = n; return INSUFFICIENT_SIZE; }
    for (unsigned int i = 0; i < n; i++) {
        s[i].pid = pids[i]; s[i].ts = since + 1; s[i].sm = util_of[i];
        s[i].mem = s[i].enc = s[i].dec = 0;
    }
    *count = n; return OK;
}

typedef struct { unsigned int pid; unsigned long long mem; unsigned int gi, ci; } procinfo_t;

static unsigned int read_pids(const char *path, unsigned int *pids, unsigned int max) {
    unsigned int n = 0;
    FILE *f = path[0] ? fopen(path, "r") : NULL;
    if (f) { while (n < max && fscanf(f, "%u", &pids[n]) == 1) n++; fclose(f); }
    return n;
}
static int running(const char *path, unsigned int *count, procinfo_t *out) {
    unsigned int pids[64], n = read_pids(path, pids, 64);
    if (out == NULL || *count < n) { int none = n == 0; *count = n; return none ? OK : INSUFFICIENT_SIZE; }
    for (unsigned int i = 0; i < n; i++) {
        out[i].pid = pids[i]; out[i].mem = 1ULL << 30; out[i].gi = out[i].ci = 0xFFFFFFFF;
    }
    *count = n; return OK;
}
int nvmlDeviceGetComputeRunningProcesses_v3(void *h, unsigned int *count, procinfo_t *out) {
    int d = dev(h);
    if (d < 0) return INVALID_ARGUMENT;
    reload();
    return running(procfile[d], count, out);
}
int nvmlDeviceGetGraphicsRunningProcesses_v3(void *h, unsigned int *count, procinfo_t *out) {
    int d = dev(h);
    if (d < 0) return INVALID_ARGUMENT;
    reload();
    return running(graphicsfile[d], count, out);
}
int nvmlDeviceGetTemperature(void *h, int sensor, unsigned int *t) {
    int d = dev(h);
    if (d < 0 || sensor != 0) return INVALID_ARGUMENT;
    reload();
    *t = temperature[d]; return OK;
}
static unsigned int current_power(int d) {
    unsigned int limit = power[d];
    FILE *f = powerlog[0] ? fopen(powerlog, "r") : NULL;
    int ld; unsigned int mw;
    if (f) { while (fscanf(f, "%d %u", &ld, &mw) == 2) if (ld == d) limit = mw; fclose(f); }
    return limit;
}
int nvmlDeviceGetPowerManagementLimit(void *h, unsigned int *mw) {
    int d = dev(h);
    if (d < 0) return INVALID_ARGUMENT;
    reload();
    *mw = current_power(d); return OK;
}
int nvmlDeviceGetPowerManagementDefaultLimit(void *h, unsigned int *mw) {
    if (dev(h) < 0) return INVALID_ARGUMENT;
    *mw = 350000; return OK;
}
int nvmlDeviceGetPowerManagementLimitConstraints(void *h, unsigned int *lo, unsigned int *hi) {
    if (dev(h) < 0) return INVALID_ARGUMENT;
    *lo = 100000; *hi = 400000; return OK;
}
int nvmlDeviceSetPowerManagementLimit(void *h, unsigned int mw) {
    int d = dev(h);
    if (d < 0 || mw < 100000 || mw > 400000) return INVALID_ARGUMENT;
    reload();
    FILE *f = powerlog[0] ? fopen(powerlog, "a") : NULL;
    if (!f) return NOT_SUPPORTED;
    fprintf(f, "%d %u\n", d, mw); fclose(f);
    return OK;
}

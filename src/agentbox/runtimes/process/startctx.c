/* The start context of runtimes/process/startctx.py in one program: what a sandbox's first
 * process does on the host before it execs its launcher (bwrap, runc), in the order the shell
 * form does it. One exec instead of three (sh, prlimit, setpriv: ~2.5 ms of the create path
 * on the 2-core host, each loading its libraries and locale).
 *
 *   startctx JOIN_FILE... -- RESOURCE VALUE ... -- UID -- COMMAND ARG...
 *
 * 1. Write its own pid into each JOIN_FILE (a cgroup's cgroup.procs): every process the
 *    sandbox will make starts inside its cgroups.
 * 2. setrlimit(RESOURCE, VALUE) for each pair, soft and hard alike (RESOURCE the kernel's
 *    number, VALUE decimal or "unlimited").
 * 3. UID "-": stay. Else no supplementary groups, real, effective and saved gid and uid all
 *    UID (the kernel clears the capabilities once no uid is 0).
 * 4. execvp(COMMAND).
 *
 * Any step that fails ends it with status 125 and the step on stderr: the launcher never runs
 * outside the sandbox's cgroups, limits or uid. It reads nothing but its arguments. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

static void fail(const char *step, const char *what) {
    fprintf(stderr, "startctx: %s %s: %s\n", step, what, strerror(errno));
    exit(125);
}

static int is_sep(const char *arg) { return arg != NULL && strcmp(arg, "--") == 0; }

static unsigned long long number(const char *text, const char *step) {
    char *end = NULL;
    errno = 0;
    unsigned long long value = strtoull(text, &end, 10);
    if (errno != 0 || end == text || *end != '\0' || text[0] == '-') {
        errno = EINVAL;
        fail(step, text);
    }
    return value;
}

int main(int argc, char **argv) {
    int i = 1;
    char pid[32];
    int len = snprintf(pid, sizeof pid, "%d", (int)getpid());
    for (; i < argc && !is_sep(argv[i]); i++) {
        int fd = open(argv[i], O_WRONLY | O_CLOEXEC);
        if (fd < 0)
            fail("joining", argv[i]);
        if (write(fd, pid, (size_t)len) != len)
            fail("joining", argv[i]);
        if (close(fd) != 0)
            fail("joining", argv[i]);
    }
    if (i++ >= argc) {
        errno = EINVAL;
        fail("arguments", "no limits");
    }
    for (; i + 1 < argc && !is_sep(argv[i]); i += 2) {
        struct rlimit lim;
        int res = (int)number(argv[i], "limit");
        rlim_t value = strcmp(argv[i + 1], "unlimited") == 0
                           ? RLIM_INFINITY
                           : (rlim_t)number(argv[i + 1], "limit");
        lim.rlim_cur = lim.rlim_max = value;
        if (setrlimit(res, &lim) != 0)
            fail("limiting", argv[i]);
    }
    if (!is_sep(argv[i]) || i + 3 >= argc || !is_sep(argv[i + 2])) {
        errno = EINVAL;
        fail("arguments", "no uid");
    }
    const char *uid_arg = argv[i + 1];
    if (strcmp(uid_arg, "-") != 0) {
        unsigned long long id = number(uid_arg, "uid");
        if (id == 0 || id > 0xfffffffe) {
            errno = EINVAL;
            fail("uid", uid_arg);
        }
        uid_t uid = (uid_t)id;
        if (setgroups(0, NULL) != 0)
            fail("dropping", "groups");
        if (setresgid(uid, uid, uid) != 0)
            fail("dropping to gid", uid_arg);
        if (setresuid(uid, uid, uid) != 0)
            fail("dropping to uid", uid_arg);
        uid_t r, e, s;
        if (getresuid(&r, &e, &s) != 0 || r != uid || e != uid || s != uid) {
            errno = EPERM;
            fail("dropping to uid", uid_arg);
        }
    }
    i += 3;
    execvp(argv[i], argv + i);
    fail("running", argv[i]);
    return 125;
}

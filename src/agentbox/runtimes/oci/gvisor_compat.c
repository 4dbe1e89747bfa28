/*
 * Preloaded into every process of a `gvisor` sandbox (/etc/ld.so.preload).
 *
 * The runsc Debian 12 ships (0.0~20221219) answers EINVAL to statx() and fstatat() calls that
 * pass AT_NO_AUTOMOUNT, a flag newer kernels ignore for these calls and coreutils always
 * passes: without this, `ls`, `stat`, `cp -a` and friends fail on every path. This drops the
 * flag and makes the call itself (gVisor mounts nothing automatically, so the answer is the
 * same). Nothing else is changed.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef AT_NO_AUTOMOUNT
#define AT_NO_AUTOMOUNT 0x800
#endif

int statx(int dirfd, const char *path, int flags, unsigned int mask, struct statx *buf)
{
    return syscall(SYS_statx, dirfd, path, flags & ~AT_NO_AUTOMOUNT, mask, buf);
}

int fstatat(int dirfd, const char *path, struct stat *buf, int flags)
{
    return syscall(SYS_newfstatat, dirfd, path, buf, flags & ~AT_NO_AUTOMOUNT);
}

int fstatat64(int dirfd, const char *path, struct stat64 *buf, int flags)
{
    return syscall(SYS_newfstatat, dirfd, path, buf, flags & ~AT_NO_AUTOMOUNT);
}

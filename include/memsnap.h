/* memsnap.h: the public C API of libmemsnap.so.
 *
 * libmemsnap.so is preloaded (LD_PRELOAD) into a CUDA program: it records every device
 * allocation and free and writes PyTorch memory-snapshot files. These four functions let
 * the program mark steps and ask for snapshots. Look them up with
 * dlsym(RTLD_DEFAULT, "memsnap_step") so that the program still runs without the preload;
 * or link against the library to call them directly.
 *
 * Every function may be called from any thread. None of them starts recording except
 * memsnap_dump and memsnap_dump_path (which start it, as the first CUDA allocation would,
 * unless MEMSNAP_DISABLE is set).
 *
 * The library's other exports are the CUDA driver and runtime functions it hooks, dlsym and
 * the libc signal functions (sigaction, signal, ...): they keep their own contracts and are
 * not declared here. tests/header.rs checks this header against the library's exports. */
#ifndef MEMSNAP_H
#define MEMSNAP_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Marks the end of a training step (MEMSNAP_SKIP, MEMSNAP_INTERVAL, MEMSNAP_EVERY,
 * MEMSNAP_STATS count these). Cheap: one event on the queue. From the first call on,
 * PyTorch's optimizer steps no longer mark steps by themselves. Returns 0, or -1 when this
 * process is not recording (a step before the first CUDA allocation starts nothing) or
 * MEMSNAP_STEPS=off. */
int memsnap_step(void);

/* Writes a snapshot now, named with tag ({tag} in MEMSNAP_FILENAME; NULL for none), and
 * returns once it is on disk: 0 on success, -1 if memsnap is off, the write failed or it
 * timed out. */
int memsnap_dump(const char *tag);

/* As memsnap_dump, and copies the written file's absolute path into path (size bytes,
 * NUL-terminated, cut to fit as snprintf does; path may be NULL). Returns the path's full
 * length in bytes without the NUL (a value >= size means it was cut), or -1 when memsnap is
 * off, the write failed or it timed out. */
int memsnap_dump_path(const char *tag, char *path, size_t size);

/* 1 while this process is recording, else 0. */
int memsnap_active(void);

#ifdef __cplusplus
}
#endif

#endif /* MEMSNAP_H */

"""cffi builder for the ring buffer's atomic word operations, compiled at install time.

The protocol needs real 64-bit compare-and-swap on shared memory, as a NIC does for RDMA
atomics; a Python-level lock would only order threads of one process. Built by setup.py
(``cffi_modules``); ``python transport/ring/_atomics_build.py`` builds it in place by hand.
"""

from cffi import FFI

ffibuilder = FFI()
ffibuilder.cdef("""
uint64_t ring_load(char *base, size_t off);
void ring_store(char *base, size_t off, uint64_t value);
uint64_t ring_cas(char *base, size_t off, uint64_t expected, uint64_t desired);
""")
ffibuilder.set_source("onepiece.transport.ring._atomics", r"""
#include <stdint.h>
#include <stddef.h>

static uint64_t ring_load(char *base, size_t off) {
    return __atomic_load_n((uint64_t *)(base + off), __ATOMIC_ACQUIRE);
}

static void ring_store(char *base, size_t off, uint64_t value) {
    __atomic_store_n((uint64_t *)(base + off), value, __ATOMIC_RELEASE);
}

/* Returns the value found, as an RDMA ATOMIC_CMP_AND_SWP does: the swap happened iff it
   equals `expected`. */
static uint64_t ring_cas(char *base, size_t off, uint64_t expected, uint64_t desired) {
    __atomic_compare_exchange_n((uint64_t *)(base + off), &expected, desired, 0,
                                __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return expected;
}
""")

if __name__ == "__main__":
    import os
    import shutil
    from pathlib import Path

    here = Path(__file__).resolve().parent
    built = Path(ffibuilder.compile(tmpdir=str(here / "build")))
    shutil.copy(built, here / built.name)
    shutil.rmtree(here / "build", ignore_errors=True)
    print(os.path.relpath(here / built.name))

"""cffi builder (API mode) for ``ray_velo.ucx._ucx_binding``, the compiled binding to libucp
(docs/architecture.md §10); ``python ray_velo/ucx/_build.py`` builds it in place."""

from __future__ import annotations

import os
import sys

import cffi  # type: ignore[import-untyped]

MODULE_NAME = "ray_velo.ucx._ucx_binding"


def ucx_prefix() -> str:
    """Directory of the installed ``libucx`` wheel (holds ``include/`` and ``lib/``).

    ``RAY_VELO_UCX_PREFIX`` overrides it, to build against another UCX installation.
    """
    override = os.environ.get("RAY_VELO_UCX_PREFIX")
    if override:
        return override
    import libucx

    return str(os.path.dirname(libucx.__file__))


CDEF = r"""
typedef int... ucs_status_t;            /* UCS_S_PACKED enum: 1 byte in C */
typedef int... ucs_thread_mode_t;
typedef int... ucp_err_handling_mode_t;
typedef int... ucs_memory_type_t;
typedef void *ucs_status_ptr_t;
typedef uint64_t ucp_datatype_t;
typedef struct ucp_context *ucp_context_h;
typedef struct ucp_worker  *ucp_worker_h;
typedef struct ucp_ep      *ucp_ep_h;
typedef struct ucp_mem     *ucp_mem_h;
typedef struct ucp_rkey    *ucp_rkey_h;
typedef struct ucp_address ucp_address_t;
typedef struct ucp_config  ucp_config_t;

typedef struct { uint64_t field_mask; uint64_t features; int mt_workers_shared; ...; } ucp_params_t;
typedef struct { uint64_t field_mask; ucs_thread_mode_t thread_mode; ...; } ucp_worker_params_t;
typedef struct { uint64_t field_mask; ucs_thread_mode_t thread_mode; ...; } ucp_worker_attr_t;
typedef void (*ucp_err_handler_cb_t)(void *arg, ucp_ep_h ep, ucs_status_t status);
typedef struct { ucp_err_handler_cb_t cb; void *arg; } ucp_err_handler_t;
typedef struct { uint64_t field_mask; const ucp_address_t *address;
                 ucp_err_handling_mode_t err_mode; ucp_err_handler_t err_handler;
                 ...; } ucp_ep_params_t;
typedef struct { uint64_t field_mask; void *address; size_t length; unsigned flags;
                 unsigned prot; ucs_memory_type_t memory_type; ...; } ucp_mem_map_params_t;
typedef struct { uint64_t field_mask; void *address; size_t length;
                 ucs_memory_type_t mem_type; ...; } ucp_mem_attr_t;
typedef struct { uint32_t op_attr_mask; uint32_t flags; ucp_mem_h memh; ...; } ucp_request_param_t;
typedef struct { const char *transport_name; const char *device_name; } ucp_transport_entry_t;
typedef struct { ucp_transport_entry_t *entries; unsigned num_entries; size_t entry_size;
                 ...; } ucp_transports_t;
typedef struct { uint64_t field_mask; ucp_transports_t transports; ...; } ucp_ep_attr_t;

#define UCP_API_MAJOR ...
#define UCP_API_MINOR ...

#define UCP_PARAM_FIELD_FEATURES ...
#define UCP_PARAM_FIELD_MT_WORKERS_SHARED ...
#define UCP_FEATURE_RMA ...
#define UCP_FEATURE_WAKEUP ...

#define UCP_WORKER_PARAM_FIELD_THREAD_MODE ...
#define UCP_WORKER_ATTR_FIELD_THREAD_MODE ...
#define UCS_THREAD_MODE_SINGLE ...
#define UCS_THREAD_MODE_SERIALIZED ...
#define UCS_THREAD_MODE_MULTI ...

#define UCP_EP_PARAM_FIELD_REMOTE_ADDRESS ...
#define UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE ...
#define UCP_EP_PARAM_FIELD_ERR_HANDLER ...
#define UCP_ERR_HANDLING_MODE_NONE ...
#define UCP_ERR_HANDLING_MODE_PEER ...
#define UCP_EP_CLOSE_FLAG_FORCE ...
#define UCP_EP_ATTR_FIELD_TRANSPORTS ...

#define UCP_MEM_MAP_PARAM_FIELD_ADDRESS ...
#define UCP_MEM_MAP_PARAM_FIELD_LENGTH ...
#define UCP_MEM_MAP_PARAM_FIELD_PROT ...
#define UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE ...
#define UCP_MEM_MAP_PROT_LOCAL_READ ...
#define UCP_MEM_MAP_PROT_LOCAL_WRITE ...
#define UCP_MEM_MAP_PROT_REMOTE_READ ...
#define UCP_MEM_MAP_PROT_REMOTE_WRITE ...
#define UCP_MEM_ATTR_FIELD_ADDRESS ...
#define UCP_MEM_ATTR_FIELD_LENGTH ...
#define UCP_MEM_ATTR_FIELD_MEM_TYPE ...
#define UCS_MEMORY_TYPE_HOST ...
#define UCS_MEMORY_TYPE_LAST ...

#define UCP_OP_ATTR_FIELD_FLAGS ...
#define UCP_OP_ATTR_FIELD_MEMH ...

#define UCS_OK ...
#define UCS_INPROGRESS ...
#define UCS_ERR_NO_MESSAGE ...
#define UCS_ERR_IO_ERROR ...
#define UCS_ERR_INVALID_PARAM ...
#define UCS_ERR_NO_ELEM ...
#define UCS_ERR_BUSY ...
#define UCS_ERR_CANCELED ...
#define UCS_ERR_TIMED_OUT ...
#define UCS_ERR_EXCEEDS_LIMIT ...
#define UCS_ERR_UNSUPPORTED ...
#define UCS_ERR_NOT_CONNECTED ...
#define UCS_ERR_CONNECTION_RESET ...
#define UCS_ERR_ENDPOINT_TIMEOUT ...
#define UCS_ERR_LAST ...

void ucp_get_version(unsigned *major, unsigned *minor, unsigned *release);
const char *ucs_status_string(ucs_status_t status);
ucs_status_t ucs_global_opts_set_value(const char *name, const char *value);
ucs_status_t ucs_global_opts_get_value(const char *name, char *value, size_t max);

ucs_status_t ucp_config_read(const char *env_prefix, const char *filename,
                             ucp_config_t **config_p);
ucs_status_t ucp_config_modify(ucp_config_t *config, const char *name, const char *value);
void ucp_config_release(ucp_config_t *config);
/* a static inline over ucp_init_version(UCP_API_MAJOR, UCP_API_MINOR, ...) */
ucs_status_t ucp_init(const ucp_params_t *params, const ucp_config_t *config,
                      ucp_context_h *context_p);
void ucp_cleanup(ucp_context_h context);

ucs_status_t ucp_worker_create(ucp_context_h context, const ucp_worker_params_t *params,
                               ucp_worker_h *worker_p);
ucs_status_t ucp_worker_query(ucp_worker_h worker, ucp_worker_attr_t *attr);
void ucp_worker_destroy(ucp_worker_h worker);
ucs_status_t ucp_worker_get_address(ucp_worker_h worker, ucp_address_t **address_p,
                                    size_t *address_length_p);
void ucp_worker_release_address(ucp_worker_h worker, ucp_address_t *address);
unsigned ucp_worker_progress(ucp_worker_h worker);
ucs_status_t ucp_worker_get_efd(ucp_worker_h worker, int *fd);
ucs_status_t ucp_worker_arm(ucp_worker_h worker);
ucs_status_t ucp_worker_signal(ucp_worker_h worker);

ucs_status_t ucp_ep_create(ucp_worker_h worker, const ucp_ep_params_t *params, ucp_ep_h *ep_p);
ucs_status_ptr_t ucp_ep_close_nbx(ucp_ep_h ep, const ucp_request_param_t *param);
ucs_status_t ucp_ep_query(ucp_ep_h ep, ucp_ep_attr_t *attr);

ucs_status_t ucp_mem_map(ucp_context_h context, const ucp_mem_map_params_t *params,
                         ucp_mem_h *memh_p);
ucs_status_t ucp_mem_unmap(ucp_context_h context, ucp_mem_h memh);
ucs_status_t ucp_mem_query(const ucp_mem_h memh, ucp_mem_attr_t *attr);
ucs_status_t ucp_rkey_pack(ucp_context_h context, ucp_mem_h memh, void **rkey_buffer_p,
                           size_t *size_p);
void ucp_rkey_buffer_release(void *rkey_buffer);
ucs_status_t ucp_ep_rkey_unpack(ucp_ep_h ep, const void *rkey_buffer, ucp_rkey_h *rkey_p);
void ucp_rkey_destroy(ucp_rkey_h rkey);

ucs_status_t ucp_request_check_status(void *request);
void ucp_request_free(void *request);

/* ---- helpers defined in SOURCE below ---- */
int rv_ptr_is_err(ucs_status_ptr_t ptr);
ucs_status_t rv_ptr_status(ucs_status_ptr_t ptr);
void rv_ep_error_cb(void *arg, ucp_ep_h ep, ucs_status_t status);
int rv_cell_load(int *cell);
void rv_cell_store(int *cell, int value);
ucs_status_ptr_t rv_get_submit(ucp_ep_h ep, void *buffer, size_t length, uint64_t remote_addr,
                               ucp_rkey_h rkey, ucp_mem_h local_memh);
ucs_status_ptr_t rv_ep_close_submit(ucp_ep_h ep, int force);
ucs_status_t rv_request_wait(ucp_worker_h worker, ucs_status_ptr_t request, double progress_s,
                             double timeout_s);
ucs_status_t rv_progress_loop(ucp_worker_h worker, int *stop, int blocking,
                              int idle_wakeup_ms, uint64_t *wakeups);
"""

SOURCE = r"""
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdint.h>
#include <time.h>
#include <ucp/api/ucp.h>
#include <ucs/config/global_opts.h>

/* UCS_PTR_* are macros: cffi cannot call them. */
static int rv_ptr_is_err(ucs_status_ptr_t ptr) { return UCS_PTR_IS_ERR(ptr); }
static ucs_status_t rv_ptr_status(ucs_status_ptr_t ptr) { return UCS_PTR_STATUS(ptr); }

/* A cell is an int that C threads write and Python reads (stop flags, error statuses). */
static int rv_cell_load(int *cell) { return __atomic_load_n(cell, __ATOMIC_ACQUIRE); }
static void rv_cell_store(int *cell, int value) { __atomic_store_n(cell, value, __ATOMIC_RELEASE); }

/* PEER-mode endpoint error handler, in C so that it runs inside ucp_worker_progress without
 * the GIL. Records the first failure status in the int cell at `arg`. Without any handler a
 * transport error on a PEER endpoint is fatal (research/ucx.md §8). */
static void rv_ep_error_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    int expected = 0;
    (void)ep;
    if (arg != NULL) {
        __atomic_compare_exchange_n((int *)arg, &expected, (int)status, 0,
                                    __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
    }
}

/* One-sided GET; the request parameters live on this C stack (UCX does not keep them). */
static ucs_status_ptr_t rv_get_submit(ucp_ep_h ep, void *buffer, size_t length,
                                      uint64_t remote_addr, ucp_rkey_h rkey,
                                      ucp_mem_h local_memh)
{
    ucp_request_param_t param;
    param.op_attr_mask = 0;
    if (local_memh != NULL) {
        param.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
        param.memh          = local_memh;
    }
    return ucp_get_nbx(ep, buffer, length, remote_addr, rkey, &param);
}

static ucs_status_ptr_t rv_ep_close_submit(ucp_ep_h ep, int force)
{
    ucp_request_param_t param;
    param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    param.flags        = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    return ucp_ep_close_nbx(ep, &param);
}

static double rv_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#define RV_IDLE_YIELDS 4096      /* idle rounds that yield before the waiter naps */
#define RV_IDLE_NAP_NS 50000     /* 50 us */
#define RV_HANDOFF_NAP_MIN_NS 10000     /* 10 us */
#define RV_HANDOFF_NAP_MAX_NS 1000000   /* 1 ms */

/* Complete a request returned by a *_nbx call. Called with the GIL released (cffi API mode).
 * progress_s: for that many seconds from the start (< 0: the whole wait) this thread drives
 *   ucp_worker_progress itself (safe beside the progress thread in MULTI mode, and needed: a
 *   cma GET is copied inside the consumer's progress); after that it only checks the request,
 *   napping 1/64 of the time waited so far (10 us to 1 ms), and leaves progress to the
 *   worker's progress thread. Two threads progressing one worker contend for its lock: over
 *   tcp the pair kept both cores of a 2-core machine busy to receive at the link's speed
 *   (docs/tuning.md, "Who progresses a long GET"). Only for a worker with a progress thread.
 * timeout_s < 0: no limit. Returns the request's final status and frees it; on timeout
 *   returns UCS_ERR_TIMED_OUT and leaves the request alive: an RMA request cannot be
 *   cancelled, only completed by force-closing its endpoint (research/ucx.md §8). */
static ucs_status_t rv_request_wait(ucp_worker_h worker, ucs_status_ptr_t request,
                                    double progress_s, double timeout_s)
{
    double started = rv_now_s();
    double deadline = (timeout_s >= 0) ? started + timeout_s : -1.0;
    double handoff = (progress_s >= 0) ? started + progress_s : -1.0;
    struct timespec nap = {0, RV_IDLE_NAP_NS};
    unsigned idle = 0;
    ucs_status_t status;
    double now;
    long nap_ns;

    if (request == NULL) {
        return UCS_OK;
    }
    if (UCS_PTR_IS_ERR(request)) {
        return UCS_PTR_STATUS(request);
    }
    for (;;) {
        status = ucp_request_check_status(request);
        if (status != UCS_INPROGRESS) {
            ucp_request_free(request);
            return status;
        }
        now = ((handoff >= 0) || (deadline >= 0)) ? rv_now_s() : 0.0;
        if ((deadline >= 0) && (now >= deadline)) {
            return UCS_ERR_TIMED_OUT;
        }
        if ((handoff >= 0) && (now >= handoff)) {
            /* the progress thread completes it: check back after a nap */
            nap_ns = (long)((now - started) * 1e9 / 64);
            nap_ns = nap_ns < RV_HANDOFF_NAP_MIN_NS ? RV_HANDOFF_NAP_MIN_NS : nap_ns;
            nap_ns = nap_ns > RV_HANDOFF_NAP_MAX_NS ? RV_HANDOFF_NAP_MAX_NS : nap_ns;
            struct timespec handed = {0, nap_ns};
            nanosleep(&handed, NULL);
            continue;
        }
        if (ucp_worker_progress(worker) != 0) {
            idle = 0;
            continue;
        }
        if (++idle < RV_IDLE_YIELDS) {
            sched_yield();  /* 2 cores: let the lock holder / the peer run */
        } else {
            nanosleep(&nap, NULL);
        }
    }
}

/* Body of a worker's progress thread; runs without the GIL.
 * blocking != 0 (needs UCP_FEATURE_WAKEUP): progress until idle, ucp_worker_arm, then sleep
 *   in poll() on the worker's event fd, so an idle worker costs ~0 CPU. idle_wakeup_ms bounds
 *   each sleep (-1: none) so timer-driven work such as PEER keepalive still runs. A submitter
 *   must ucp_worker_signal() after posting work, or the work waits for the next event.
 * blocking == 0: busy progress with sched_yield() when idle (MULTI mode: lets other threads
 *   take the worker lock; without it issuing threads starve, research/ucx.md §7).
 * Stop: rv_cell_store(stop, 1), then ucp_worker_signal(). A signal that lands before
 *   ucp_worker_arm makes it return UCS_ERR_BUSY, so no wakeup is lost.
 * Returns UCS_OK when stopped, else the status that ended the loop. */
static ucs_status_t rv_progress_loop(ucp_worker_h worker, int *stop, int blocking,
                                     int idle_wakeup_ms, uint64_t *wakeups)
{
    struct pollfd pfd;
    ucs_status_t status;
    int efd = -1;
    int ret;

    if (blocking) {
        status = ucp_worker_get_efd(worker, &efd);
        if (status != UCS_OK) {
            return status;
        }
    }
    pfd.fd     = efd;
    pfd.events = POLLIN;

    while (!rv_cell_load(stop)) {
        if (ucp_worker_progress(worker) != 0) {
            continue;
        }
        if (!blocking) {
            sched_yield();
            continue;
        }
        status = ucp_worker_arm(worker);
        if (status == UCS_ERR_BUSY) {
            continue;  /* events arrived (or a signal): progress again */
        } else if (status != UCS_OK) {
            return status;
        }
        if (rv_cell_load(stop)) {
            break;
        }
        pfd.revents = 0;
        ret = poll(&pfd, 1, idle_wakeup_ms);
        if ((ret < 0) && (errno != EINTR)) {
            return UCS_ERR_IO_ERROR;
        }
        if (wakeups != NULL) {
            ++*wakeups;
        }
    }
    return UCS_OK;
}
"""


def make_builder(prefix: str | None = None) -> cffi.FFI:
    """The configured builder; include/lib dirs from the UCX installation at ``prefix``."""
    root = prefix if prefix is not None else ucx_prefix()
    builder = cffi.FFI()
    builder.cdef(CDEF)
    builder.set_source(
        MODULE_NAME,
        SOURCE,
        include_dirs=[os.path.join(root, "include")],
        library_dirs=[os.path.join(root, "lib")],
        libraries=["ucp", "ucs"],
        # No rpath on purpose: libucx.load_library() preloads libucs/libuct/libucp (RTLD_LOCAL)
        # and the loader then satisfies DT_NEEDED libucp.so.0 by soname.
        extra_compile_args=["-O2", "-Wno-sign-compare"],
        # Stable ABI (cffi's default, said here because the abi3 wheel depends on it): one
        # `.abi3.so` serves every CPython >= 3.10 (`.ci/wheel` tags the wheel cp310-abi3).
        py_limited_api=True,
    )
    return builder


ffibuilder = make_builder()


def build_in_place() -> str:
    """Compile the extension next to this file (no pip); returns the path of the module.

    Other builds of it (``.abi3.so`` from ``pip install -e``, or another Python's) are removed
    first, so the interpreter cannot pick a stale one.
    """
    import glob
    import shutil
    import tempfile

    here = os.path.dirname(os.path.abspath(__file__))
    for stale in glob.glob(os.path.join(here, "_ucx_binding*.so")):
        os.remove(stale)
    # The same file name that `pip install -e .` gives it (cffi's C is limited-API code).
    dest = os.path.join(here, "_ucx_binding.abi3.so")
    with tempfile.TemporaryDirectory(prefix="ray_velo_cffi_") as tmp:
        built = ffibuilder.compile(tmpdir=tmp, verbose=False)
        shutil.copyfile(built, dest)
    return dest


if __name__ == "__main__":
    sys.stdout.write(f"built {build_in_place()}\n")

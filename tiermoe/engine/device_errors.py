"""Errors after which the GPU cannot be used again by this process: the engine stops instead of retrying.

CUDA reports some faults as sticky: after an illegal memory access, a device-side assert or a launch failure the
context is poisoned and every later call on it fails with the same error. Re-running a failed step's sequences in
halves (tiermoe.engine.step_isolation) would then fail every half, blame every sequence, and leave a server that
answers /health while no request can succeed. Such an error is recognised here by CUDA's own error text (the same
in torch.AcceleratorError, which recent torch raises, and in the RuntimeError older torch and Triton raise) and
turned into a DeviceLostError: fatal, so the server fails its running requests and exits non-zero for a
supervisor to restart it (tiermoe.server.engine_service).
"""

from __future__ import annotations

from tiermoe.errors import TiermoeError, cause_chain

# cudaGetErrorString's text of the errors that corrupt the context (cudaErrorIllegalAddress, Assert, LaunchFailure,
# IllegalInstruction, MisalignedAddress, InvalidAddressSpace, InvalidPc, HardwareStackError, LaunchTimeout,
# ECCUncorrectable); an out-of-memory or invalid-argument error leaves the context usable and is not here.
STICKY_CUDA_ERRORS = (
    "an illegal memory access was encountered",
    "device-side assert triggered",
    "unspecified launch failure",
    "an illegal instruction was encountered",
    "misaligned address",
    "operation not supported on global/shared address space",
    "invalid program counter",
    "hardware stack error",
    "the launch timed out and was terminated",
    "uncorrectable ecc error encountered",
)


class DeviceLostError(TiermoeError):
    """The GPU's context is unusable after a sticky CUDA error: the process must be restarted."""

    fatal = True


def sticky_device_error(err: BaseException | None) -> BaseException | None:
    """The error in `err`'s cause chain that poisons the CUDA context, if any."""
    return next((e for e in cause_chain(err) if isinstance(e, RuntimeError)
                 and any(text in str(e).lower() for text in STICKY_CUDA_ERRORS)), None)


def device_lost(err: BaseException) -> DeviceLostError:
    """The fatal error to raise for the sticky error `err` (its first line, and what to do)."""
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return DeviceLostError(f"the GPU failed with an unrecoverable error ({type(err).__name__}: {first_line}); "
                           "every request in flight failed, and the process must restart to use the GPU again")

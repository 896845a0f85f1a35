package gpu

import (
	"errors"
	"fmt"
)

// Errors returned by this package. Test for them with errors.Is: they are
// wrapped with context, and a *DriverError matches the sentinel of its
// class (see DriverError.Is).
var (
	// ErrNoDriver is returned by Open when the CUDA driver cannot be used:
	// libcuda.so.1 is not installed, is a stub, lacks an entry point this
	// package needs, or the package was built without cgo. OpenHost is
	// always available instead.
	ErrNoDriver = errors.New("gpu: no CUDA driver")

	// ErrNoDevice is returned by Open when the driver is present but the
	// machine has no CUDA device, or none with the requested ordinal.
	ErrNoDevice = errors.New("gpu: no CUDA device")

	// ErrBusy is returned by Close (of a Device, an arena or a CopyEngine)
	// while something still depends on it: copies in flight, quarantined
	// copies, live arenas or engines. The wrapping error names what is
	// still alive. Nothing is freed when Close refuses; call it again later.
	ErrBusy = errors.New("gpu: still in use")

	// ErrClosed is returned when a closed Device or CopyEngine is used. A
	// region of a closed arena is refused as invalid input instead: it lies
	// in no live arena.
	ErrClosed = errors.New("gpu: closed")

	// ErrDeviceFailed is matched by driver errors that leave the context
	// unusable (sticky errors such as CUDA_ERROR_ILLEGAL_ADDRESS, or a
	// destroyed context). After one, no copy on the device can be proven
	// finished: transfers in flight are quarantined, the copy engine refuses
	// new work, and only a new process gets a working device back.
	ErrDeviceFailed = errors.New("gpu: device failed")
)

// Result is a CUDA driver status code (CUresult).
type Result int

// Driver status codes this package interprets. Other codes pass through as
// they are.
const (
	Success                 Result = 0
	ErrorInvalidValue       Result = 1
	ErrorOutOfMemory        Result = 2
	ErrorNotInitialized     Result = 3
	ErrorDeinitialized      Result = 4
	ErrorStubLibrary        Result = 34
	ErrorNoDevice           Result = 100
	ErrorInvalidDevice      Result = 101
	ErrorInvalidContext     Result = 201
	ErrorECCUncorrectable   Result = 214
	ErrorNvlinkUncorrect    Result = 220
	ErrorContained          Result = 226
	ErrorInvalidHandle      Result = 400
	ErrorNotFound           Result = 500
	ErrorNotReady           Result = 600
	ErrorIllegalAddress     Result = 700
	ErrorLaunchTimeout      Result = 702
	ErrorContextDestroyed   Result = 709
	ErrorAssert             Result = 710
	ErrorHardwareStack      Result = 714
	ErrorIllegalInstruction Result = 715
	ErrorMisalignedAddress  Result = 716
	ErrorInvalidAddrSpace   Result = 717
	ErrorInvalidPC          Result = 718
	ErrorLaunchFailed       Result = 719
	ErrorTensorMemoryLeak   Result = 721
	ErrorNotSupported       Result = 801
	ErrorSystemDriver       Result = 803
	ErrorMPSClientKilled    Result = 810
	ErrorExternalDevice     Result = 911
	ErrorUnknown            Result = 999
)

// knownResults names the codes above for backends that cannot ask the
// driver (the CPU fallback, or a driver whose cuGetErrorName fails).
var knownResults = map[Result][2]string{
	Success:                 {"CUDA_SUCCESS", "no error"},
	ErrorInvalidValue:       {"CUDA_ERROR_INVALID_VALUE", "invalid argument"},
	ErrorOutOfMemory:        {"CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
	ErrorNotInitialized:     {"CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
	ErrorDeinitialized:      {"CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
	ErrorStubLibrary:        {"CUDA_ERROR_STUB_LIBRARY", "CUDA driver is a stub library"},
	ErrorNoDevice:           {"CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
	ErrorInvalidDevice:      {"CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
	ErrorInvalidContext:     {"CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
	ErrorECCUncorrectable:   {"CUDA_ERROR_ECC_UNCORRECTABLE", "uncorrectable ECC error encountered"},
	ErrorNvlinkUncorrect:    {"CUDA_ERROR_NVLINK_UNCORRECTABLE", "uncorrectable NVLink error detected during the execution"},
	ErrorContained:          {"CUDA_ERROR_CONTAINED", "an exception on the device was contained by the GPU's error containment"},
	ErrorInvalidHandle:      {"CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
	ErrorNotFound:           {"CUDA_ERROR_NOT_FOUND", "named symbol not found"},
	ErrorNotReady:           {"CUDA_ERROR_NOT_READY", "device not ready"},
	ErrorIllegalAddress:     {"CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
	ErrorLaunchTimeout:      {"CUDA_ERROR_LAUNCH_TIMEOUT", "the launch timed out and was terminated"},
	ErrorContextDestroyed:   {"CUDA_ERROR_CONTEXT_IS_DESTROYED", "context is destroyed"},
	ErrorAssert:             {"CUDA_ERROR_ASSERT", "device-side assert triggered"},
	ErrorHardwareStack:      {"CUDA_ERROR_HARDWARE_STACK_ERROR", "hardware stack error"},
	ErrorIllegalInstruction: {"CUDA_ERROR_ILLEGAL_INSTRUCTION", "an illegal instruction was encountered"},
	ErrorMisalignedAddress:  {"CUDA_ERROR_MISALIGNED_ADDRESS", "misaligned address"},
	ErrorInvalidAddrSpace:   {"CUDA_ERROR_INVALID_ADDRESS_SPACE", "operation not supported on global/shared address space"},
	ErrorInvalidPC:          {"CUDA_ERROR_INVALID_PC", "invalid program counter"},
	ErrorLaunchFailed:       {"CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
	ErrorTensorMemoryLeak:   {"CUDA_ERROR_TENSOR_MEMORY_LEAK", "a kernel exited without deallocating its tensor memory"},
	ErrorNotSupported:       {"CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
	ErrorSystemDriver:       {"CUDA_ERROR_SYSTEM_DRIVER_MISMATCH", "system has unsupported display driver / cuda driver combination"},
	ErrorMPSClientKilled:    {"CUDA_ERROR_MPS_CLIENT_TERMINATED", "the MPS client has been terminated by the server"},
	ErrorExternalDevice:     {"CUDA_ERROR_EXTERNAL_DEVICE", "an asynchronous error occurred in a device outside of CUDA"},
	ErrorUnknown:            {"CUDA_ERROR_UNKNOWN", "unknown error"},
}

// Sticky reports whether r leaves the CUDA context unusable: after it every
// later call in the process fails, so nothing in flight can be proven to
// have stopped. The set is the driver API's list of results whose
// description ends "the process must be terminated and relaunched"
// (contained errors, illegal address, launch timeout and failure, device
// assert, hardware stack, illegal instruction, misaligned address, invalid
// address space or PC, tensor memory leak, MPS client terminated, external
// device), plus what this package treats the same way for the same reason:
// the lost-context codes (deinitialized, invalid or destroyed context),
// uncorrectable ECC and NVLink errors, and CUDA_ERROR_UNKNOWN.
func (r Result) Sticky() bool {
	switch r {
	case ErrorDeinitialized, ErrorInvalidContext, ErrorContextDestroyed,
		ErrorECCUncorrectable, ErrorNvlinkUncorrect, ErrorContained,
		ErrorIllegalAddress, ErrorLaunchTimeout, ErrorAssert,
		ErrorHardwareStack, ErrorIllegalInstruction, ErrorMisalignedAddress,
		ErrorInvalidAddrSpace, ErrorInvalidPC, ErrorLaunchFailed,
		ErrorTensorMemoryLeak, ErrorMPSClientKilled, ErrorExternalDevice,
		ErrorUnknown:
		return true
	}
	return false
}

// DriverError is a failed CUDA driver call: Op is the entry point
// ("cuMemAlloc"), Code its result, Name and Text what cuGetErrorName and
// cuGetErrorString say about it (or this package's table, on the CPU
// fallback). errors.Is matches ErrNoDevice, ErrNoDriver and ErrDeviceFailed
// for the codes of those classes.
type DriverError struct {
	Op   string
	Code Result
	Name string
	Text string
}

// Error formats the error as "gpu: <op>: <name> (<code>): <text>".
func (e *DriverError) Error() string {
	return fmt.Sprintf("gpu: %s: %s (%d): %s", e.Op, e.Name, int(e.Code), e.Text)
}

// Is matches the sentinel of the error's class.
func (e *DriverError) Is(target error) bool {
	switch target {
	case ErrNoDevice:
		return e.Code == ErrorNoDevice || e.Code == ErrorInvalidDevice
	case ErrNoDriver:
		return e.Code == ErrorStubLibrary || e.Code == ErrorSystemDriver
	case ErrDeviceFailed:
		return e.Code.Sticky()
	}
	return false
}

// newDriverError builds a DriverError from the package's table, for codes
// the driver was not asked to name.
func newDriverError(op string, code Result) *DriverError {
	e := &DriverError{Op: op, Code: code}
	if nt, ok := knownResults[code]; ok {
		e.Name, e.Text = nt[0], nt[1]
	} else {
		e.Name, e.Text = fmt.Sprintf("CUDA_ERROR_%d", int(code)), "unrecognized error code"
	}
	return e
}

// isSticky reports whether err carries a sticky driver result.
func isSticky(err error) bool {
	var de *DriverError
	return errors.As(err, &de) && de.Code.Sticky()
}

// A no-op CUDA device guard for a CPU-only torch, loaded by tests/test_fake_cuda.py only. Python
// indexing, cross-device copies and a few other calls open a device guard for a tensor's device;
// under FakeTensorMode a fake CUDA tensor needs one that does nothing. torch's own
// `_ensureCUDADeviceGuardSet` installs this guard only for a CUDA build with no device, not for a
// CPU-only build.
#include <c10/core/impl/DeviceGuardImplInterface.h>

C10_REGISTER_GUARD_IMPL(CUDA, c10::impl::NoOpDeviceGuardImpl<c10::DeviceType::CUDA>);

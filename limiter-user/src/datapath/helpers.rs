//! The helper programs: never attached, run by the agent through `BPF_PROG_TEST_RUN` with a
//! request as the packet, so that releasing a flow or repairing a counter happens in the
//! kernel with the datapath's own atomics instead of racing it from userspace.

use aya::{
    TestRun,
    programs::{TestRunOptions, Xdp},
};
use limiter_common::{AdjustRequest, FlowKey, ReleaseRequest, release};

use super::{
    Datapath, LoadError,
    programs::{ADJUST_PROGRAM, RELEASE_PROGRAM, program},
};

impl Datapath {
    /// Removes a flow and releases its slots exactly once, with the kernel's own atomics
    /// (through the release program), so it can never race the datapath into a double
    /// release. Returns whether this call released it.
    pub fn release(&mut self, flow: &FlowKey) -> Result<bool, LoadError> {
        self.run_helper(RELEASE_PROGRAM, &ReleaseRequest { flow: *flow })
    }

    /// Adds `delta` to a source's counter (or the global one), atomically in the kernel.
    pub fn adjust(&mut self, request: &AdjustRequest) -> Result<bool, LoadError> {
        self.run_helper(ADJUST_PROGRAM, request)
    }

    /// Runs one of the helper programs with `request` as its packet.
    fn run_helper<T: aya::Pod>(
        &mut self,
        name: &'static str,
        request: &T,
    ) -> Result<bool, LoadError> {
        // SAFETY: `T: Pod` is plain data with no padding the compiler adds.
        let bytes = unsafe {
            std::slice::from_raw_parts((request as *const T).cast::<u8>(), std::mem::size_of::<T>())
        };
        let result = program::<Xdp>(&mut self.ebpf, name)?
            .test_run(TestRunOptions {
                data_in: Some(bytes),
                ..Default::default()
            })
            .map_err(|source| LoadError::Program { name, source })?;
        match result.return_value {
            release::RELEASED => Ok(true),
            release::ABSENT => Ok(false),
            other => Err(LoadError::Release(other)),
        }
    }
}

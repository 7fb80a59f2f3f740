//! The helper programs: never attached, run by the agent through `BPF_PROG_TEST_RUN` with a
//! request as the packet, so that releasing a flow, adopting one or repairing a counter
//! happens in the kernel with the datapath's own atomics instead of racing it from userspace.

use aya::{
    TestRun,
    programs::{TestRunOptions, Xdp},
};
use limiter_common::{AdjustRequest, FlowKey, FlowRequest, ProfileSource, helper};

use super::{
    Datapath, LoadError,
    programs::{ADJUST_PROGRAM, ADOPT_PROGRAM, RELEASE_PROGRAM, program},
};

/// What adopting a connection did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Adoption {
    /// Entered and counted, within the caps.
    Adopted,
    /// Entered and counted, past a cap.
    OverCap,
    /// Tracked already, not limiter's to count (a port not protected, an allowlisted source),
    /// or no room in the table.
    Skipped,
}

impl Datapath {
    /// Removes a flow and releases its slots exactly once, with the kernel's own atomics
    /// (through the release program), so it can never race the datapath into a double
    /// release. Returns whether this call released it.
    pub fn release(&mut self, flow: &FlowKey) -> Result<bool, LoadError> {
        Ok(self.run_helper(RELEASE_PROGRAM, &FlowRequest { flow: *flow })? == helper::DONE)
    }

    /// Adds `delta` to a source's counter (or the global one), atomically in the kernel.
    pub fn adjust(&mut self, request: &AdjustRequest) -> Result<bool, LoadError> {
        Ok(self.run_helper(ADJUST_PROGRAM, request)? == helper::DONE)
    }

    /// Removes a source's counter entry in a profile if it holds zero, in the kernel, which
    /// retires it first: a handshake taking a slot at the same moment either comes first (the
    /// entry stays) or finds the entry retired and takes its slot in a fresh one. Returns
    /// whether it removed the entry.
    pub fn remove_idle_source(&mut self, counted: &ProfileSource) -> Result<bool, LoadError> {
        self.adjust(&AdjustRequest::source(counted, 0))
    }

    /// Enters an established connection the flow table lacks and takes its slots, in the
    /// kernel (see `decide::adopt` in the kernel crate).
    pub fn adopt(&mut self, flow: &FlowKey) -> Result<Adoption, LoadError> {
        Ok(
            match self.run_helper(ADOPT_PROGRAM, &FlowRequest { flow: *flow })? {
                helper::DONE => Adoption::Adopted,
                helper::OVER_CAP => Adoption::OverCap,
                _ => Adoption::Skipped,
            },
        )
    }

    /// Runs one of the helper programs with `request` as its packet; returns its answer, one
    /// of [`helper`]'s.
    fn run_helper<T: aya::Pod>(
        &mut self,
        name: &'static str,
        request: &T,
    ) -> Result<u32, LoadError> {
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
            answer @ (helper::DONE | helper::ABSENT | helper::OVER_CAP) => Ok(answer),
            other => Err(LoadError::Helper(other)),
        }
    }
}

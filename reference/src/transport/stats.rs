//! What one call put on the wire, counted by the CPU backend for both paths.

/// Per-call counts of one rank's sends.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CallStats {
    /// Puts: one per selection on the per-expert path, one per (source, destination) batch on
    /// the batched path.
    pub messages: u64,
    /// Signals posted.
    pub signals: u64,
    /// Bytes written into peers' buffers (payload, metadata and headers).
    pub wire_bytes: u64,
}

impl std::ops::AddAssign for CallStats {
    fn add_assign(&mut self, o: CallStats) {
        self.messages += o.messages;
        self.signals += o.signals;
        self.wire_bytes += o.wire_bytes;
    }
}

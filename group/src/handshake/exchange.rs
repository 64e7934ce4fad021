//! One all-gather round: every rank's record travels with its payload (the IPC handle, the NCCL
//! unique id), and every peer's record is decoded and compared before the payloads are handed
//! back in rank order.

use crate::error::GroupError;
use crate::handshake::record::Hello;
use crate::wire::BlobError;

/// Process mode's exchange: every rank's blob, in rank order (e.g. `Rendezvous::all_gather`).
pub type AllGather<'a> = dyn FnMut(&[u8]) -> Result<Vec<Vec<u8>>, String> + 'a;

/// Checks every rank's blob of one all-gather round against `ours` and returns the payloads in
/// rank order. `all` must hold exactly one blob per rank of `ours.config`.
pub fn verify_all(ours: &Hello, all: &[Vec<u8>]) -> Result<Vec<Vec<u8>>, GroupError> {
    Ok(verify_records(ours, all)?
        .into_iter()
        .map(|(_, p)| p)
        .collect())
}

/// [`verify_all`], with every rank's checked record beside its payload.
pub fn verify_records(ours: &Hello, all: &[Vec<u8>]) -> Result<Vec<(Hello, Vec<u8>)>, GroupError> {
    let world = ours.config.num_ranks;
    if all.len() != world {
        return Err(GroupError::Process(format!(
            "rank {}: the handshake exchange returned {} blobs, want one per rank ({world})",
            ours.rank,
            all.len()
        )));
    }
    let mut payloads = Vec::with_capacity(world);
    for (peer, blob) in all.iter().enumerate() {
        let (theirs, payload) = match Hello::decode(blob) {
            Ok(x) => x,
            Err(BlobError::OtherProtocol { found }) => {
                return Err(GroupError::PeerMismatch {
                    field: "protocol version",
                    ours: ours.protocol.to_string(),
                    theirs: found.to_string(),
                    rank: ours.rank,
                    peer,
                })
            }
            Err(error) => {
                return Err(GroupError::PeerBlob {
                    rank: ours.rank,
                    peer,
                    error,
                })
            }
        };
        ours.compare(&theirs, peer)?;
        payloads.push((theirs, payload.to_vec()));
    }
    Ok(payloads)
}

/// One all-gather round carrying `ours` and `payload`: every peer's record is checked (see
/// [`verify_all`]) and the payloads come back in rank order.
pub fn exchange(
    all_gather: &mut AllGather<'_>,
    ours: &Hello,
    payload: &[u8],
) -> Result<Vec<Vec<u8>>, GroupError> {
    Ok(exchange_records(all_gather, ours, payload)?
        .into_iter()
        .map(|(_, p)| p)
        .collect())
}

/// [`exchange`], with every rank's checked record (its node, above all) beside its payload.
pub fn exchange_records(
    all_gather: &mut AllGather<'_>,
    ours: &Hello,
    payload: &[u8],
) -> Result<Vec<(Hello, Vec<u8>)>, GroupError> {
    let blob = ours.encode(payload)?;
    let all = all_gather(&blob).map_err(GroupError::Process)?;
    verify_records(ours, &all)
}

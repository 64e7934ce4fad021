//! Handing rank 0's listening socket from the launcher to the child.
//!
//! Picking a free port by binding port 0 and closing it again leaves a window in which another
//! process can take the port before rank 0 binds it. Instead [`spawn_local`](crate::spawn_local)
//! binds `127.0.0.1:0` itself, keeps that socket open through rank 0's `exec` (the descriptor
//! is inherited, its number in `EP_RDZV_LISTEN_FD`), and rank 0 listens on it: the port is held
//! from the moment it is chosen until the rendezvous is formed.

use std::net::TcpListener;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::vars::EP_RDZV_LISTEN_FD;

/// Whether this process already took its inherited listener (it is handed over once; a second
/// rendezvous in the same process binds the port the ordinary way). Relaxed is enough: the flag
/// guards only against a second take, and `swap` is atomic whatever the ordering.
static TAKEN: AtomicBool = AtomicBool::new(false);

extern "C" {
    fn fcntl(fd: i32, cmd: i32, ...) -> i32;
}
const F_SETFD: i32 = 2;

/// Makes `listener` survive the `exec` of the child `cmd` starts (only in that child), at the
/// same descriptor number, which the caller passes in [`EP_RDZV_LISTEN_FD`].
pub(crate) fn pass_to_child(cmd: &mut Command, listener: &TcpListener) -> RawFd {
    let fd = listener.as_raw_fd();
    // SAFETY: runs in the forked child before exec; fcntl(F_SETFD) is async-signal-safe and
    // only clears the close-on-exec flag of the child's copy of `fd`, which is open (the parent
    // holds `listener` until the spawn returns). The parent's descriptor keeps its flag.
    unsafe {
        cmd.pre_exec(move || {
            if fcntl(fd, F_SETFD, 0) == -1 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    fd
}

/// The listener the launcher handed to this process as descriptor `fd`, if it is a TCP socket
/// bound to `port`. `Ok(None)` when it was already taken in this process.
pub(crate) fn take(fd: RawFd, port: u16) -> Result<Option<TcpListener>, String> {
    if fd < 3 {
        return Err(format!("{EP_RDZV_LISTEN_FD}={fd} names a standard stream"));
    }
    if TAKEN.swap(true, Ordering::Relaxed) {
        return Ok(None);
    }
    // SAFETY: by the launcher's contract `fd` is a descriptor it left open for this process,
    // and TAKEN makes this the only use of it here. It is only borrowed for the duplication;
    // a number that is not open makes the dup fail with EBADF, which is reported.
    let dup = unsafe { BorrowedFd::borrow_raw(fd) }
        .try_clone_to_owned()
        .map_err(|e| format!("{EP_RDZV_LISTEN_FD}={fd}: {e}"))?;
    let listener = TcpListener::from(dup);
    let addr = listener
        .local_addr()
        .map_err(|e| format!("{EP_RDZV_LISTEN_FD}={fd} is not a TCP socket: {e}"))?;
    if addr.port() != port {
        return Err(format!(
            "{EP_RDZV_LISTEN_FD}={fd} is bound to {addr}, not to the rendezvous port {port}"
        ));
    }
    // SAFETY: `fd` is the inherited listener (checked above) and nothing else in this process
    // uses it (TAKEN); closing it leaves the duplicate, which has close-on-exec set, so the
    // socket does not leak into this process's own children.
    drop(unsafe { OwnedFd::from_raw_fd(fd) });
    Ok(Some(listener))
}

//! System calls that the server and a sandbox's holder share and std does not wrap: passing
//! descriptors over a socket, waiting on one, pidfds, and loopback sockets made elsewhere.

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd};
use std::os::unix::ffi::OsStrExt as _;
use std::path::Path;
use std::time::Duration;

/// The most descriptors one message carries.
const MAX_FDS: usize = 16;

/// `Ok` for a system call's non-negative result, the error in `errno` otherwise.
pub(super) fn check(result: libc::c_int) -> io::Result<libc::c_int> {
    if result < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(result)
    }
}

/// A path as a C string.
pub(super) fn cpath(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| io::Error::other("a path holds NUL"))
}

/// Takes ownership of a descriptor the kernel just returned (or the error in `errno`).
fn owned(fd: libc::c_int) -> io::Result<OwnedFd> {
    check(fd)?;
    // SAFETY: `fd` was just returned by the kernel and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A connected pair of `SOCK_SEQPACKET` sockets (message boundaries kept), close-on-exec.
pub(super) fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: socketpair(2) writes two descriptors into the array.
    check(unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC,
            0,
            fds.as_mut_ptr(),
        )
    })?;
    Ok((owned(fds[0])?, owned(fds[1])?))
}

/// Sends one message with `fds` attached (`SCM_RIGHTS`).
pub(super) fn send(socket: BorrowedFd<'_>, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    if fds.len() > MAX_FDS {
        return Err(io::Error::other("too many descriptors for one message"));
    }
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr().cast_mut().cast(),
        iov_len: bytes.len(),
    };
    let raw: Vec<libc::c_int> = fds.iter().map(|f| f.as_raw_fd()).collect();
    let payload = std::mem::size_of_val(raw.as_slice());
    // u64s keep the control buffer aligned for `cmsghdr`.
    let mut control = vec![0u64; 64];
    // SAFETY: msghdr is plain data; every pointer in it points into buffers that outlive the
    // sendmsg(2) call, and the control buffer (512 bytes) holds CMSG_SPACE of 16 descriptors.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        if !raw.is_empty() {
            msg.msg_control = control.as_mut_ptr().cast();
            msg.msg_controllen = libc::CMSG_SPACE(payload as u32) as usize;
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(payload as u32) as usize;
            std::ptr::copy_nonoverlapping(
                raw.as_ptr().cast::<u8>(),
                libc::CMSG_DATA(cmsg),
                payload,
            );
        }
        loop {
            let sent = libc::sendmsg(socket.as_raw_fd(), &msg, libc::MSG_NOSIGNAL);
            if sent >= 0 {
                return Ok(());
            }
            let err = io::Error::last_os_error();
            if err.kind() != io::ErrorKind::Interrupted {
                return Err(err);
            }
        }
    }
}

/// Receives one message of at most `max` bytes and the descriptors attached to it (opened
/// close-on-exec). The peer having closed its end is `UnexpectedEof`.
pub(super) fn recv(socket: BorrowedFd<'_>, max: usize) -> io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    let mut bytes = vec![0u8; max];
    let mut iov = libc::iovec {
        iov_base: bytes.as_mut_ptr().cast(),
        iov_len: bytes.len(),
    };
    let mut control = vec![0u64; 64];
    // SAFETY: as in `send`; the kernel writes at most `msg_controllen` bytes of control data
    // and at most `max` bytes of payload, and every descriptor it passes is taken over once.
    unsafe {
        let mut msg: libc::msghdr = std::mem::zeroed();
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = std::mem::size_of_val(control.as_slice());
        let got = loop {
            let got = libc::recvmsg(socket.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC);
            if got >= 0 {
                break got as usize;
            }
            let err = io::Error::last_os_error();
            if err.kind() != io::ErrorKind::Interrupted {
                return Err(err);
            }
        };
        let mut fds = Vec::new();
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg);
                let len = (*cmsg).cmsg_len - (data as usize - cmsg as usize);
                for i in 0..len / std::mem::size_of::<libc::c_int>() {
                    let fd = std::ptr::read_unaligned(data.cast::<libc::c_int>().add(i));
                    fds.push(OwnedFd::from_raw_fd(fd));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
        if got == 0 && fds.is_empty() {
            return Err(io::Error::from(io::ErrorKind::UnexpectedEof));
        }
        if msg.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 {
            return Err(io::Error::other("a message was cut short"));
        }
        bytes.truncate(got);
        Ok((bytes, fds))
    }
}

/// Waits until `fd` is readable (or its peer hung up); false when `limit` passed first.
pub(super) fn wait_readable(fd: BorrowedFd<'_>, limit: Duration) -> io::Result<bool> {
    let deadline = std::time::Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let mut poll = libc::pollfd {
            fd: fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = libc::c_int::try_from(left.as_millis()).unwrap_or(libc::c_int::MAX);
        // SAFETY: poll(2) on one pollfd that lives on this stack frame.
        let ready = unsafe { libc::poll(&mut poll, 1, ms) };
        match ready {
            0 => return Ok(false),
            n if n > 0 => return Ok(true),
            _ => {
                let err = io::Error::last_os_error();
                if err.kind() != io::ErrorKind::Interrupted {
                    return Err(err);
                }
            }
        }
    }
}

/// A pidfd of `pid` (pidfd_open(2)).
pub(super) fn pidfd_open(pid: libc::pid_t) -> io::Result<OwnedFd> {
    // SAFETY: pidfd_open(2) takes a PID and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    owned(libc::c_int::try_from(fd).map_err(io::Error::other)?)
}

/// SIGKILLs the process of a pidfd: never another one, even after its PID was reused.
pub(super) fn pidfd_kill(pidfd: BorrowedFd<'_>) {
    // SAFETY: pidfd_send_signal(2) on a pidfd the caller holds, with no siginfo.
    unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
}

/// `127.0.0.1:port` as a `sockaddr_in`.
fn loopback(port: u16) -> libc::sockaddr_in {
    libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(std::net::Ipv4Addr::LOCALHOST).to_be(),
        },
        sin_zero: [0; 8],
    }
}

/// Connects a TCP socket (made in whatever network namespace) to `127.0.0.1:port` there.
pub(super) fn connect_loopback(socket: OwnedFd, port: u16) -> io::Result<std::net::TcpStream> {
    let addr = loopback(port);
    loop {
        // SAFETY: connect(2) with a sockaddr_in that lives on this stack frame.
        let done = unsafe {
            libc::connect(
                socket.as_raw_fd(),
                (&raw const addr).cast(),
                std::mem::size_of_val(&addr) as libc::socklen_t,
            )
        };
        if done == 0 {
            return Ok(std::net::TcpStream::from(socket));
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// Binds a TCP socket (made in whatever network namespace) to `127.0.0.1:port` there and
/// listens on it, with `SO_REUSEADDR` as std's listeners have it.
pub(super) fn listen_loopback(socket: OwnedFd, port: u16) -> io::Result<std::net::TcpListener> {
    let addr = loopback(port);
    let one: libc::c_int = 1;
    // SAFETY: setsockopt(2), bind(2) and listen(2) on a socket this function owns, with
    // arguments that live on this stack frame.
    unsafe {
        check(libc::setsockopt(
            socket.as_fd().as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_REUSEADDR,
            (&raw const one).cast(),
            std::mem::size_of_val(&one) as libc::socklen_t,
        ))?;
        check(libc::bind(
            socket.as_raw_fd(),
            (&raw const addr).cast(),
            std::mem::size_of_val(&addr) as libc::socklen_t,
        ))?;
        check(libc::listen(socket.as_raw_fd(), 128))?;
    }
    Ok(std::net::TcpListener::from(socket))
}

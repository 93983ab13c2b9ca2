//! The names of the reference server's negative controls: deliberate, realistic bugs that
//! `sandspec serve --defect <name>` switches on one at a time.
//!
//! Every MUST scenario names the defects it catches, and the conformance tests prove that it
//! fails against each of them. The names are stable: scenarios refer to them. This crate holds
//! only the names and what each one breaks, so that the runner's scenario parser can check a
//! scenario's defects without depending on the reference server; the server decides whether a
//! build may switch any of them on.

use std::fmt;
use std::str::FromStr;

/// One deliberate bug.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Defect {
    /// Closing a borrowed connection kills the owner's sandbox.
    BorrowerCloseKillsOwner,
    /// A bare ID is looked up in every provider, not only the default one.
    BareIdAnyProvider,
    /// A qualified ID's provider is ignored on kill: the first provider holding the local ID wins.
    KillIgnoresProvider,
    /// Resources are granted smaller than asked (half the memory), and the readback says so.
    UndersizedGrant,
    /// An unsatisfiable create answers 422 but leaves a sandbox behind.
    UnsatisfiableLeaks,
    /// A resumed SSE stream skips the first event after the cursor.
    SseResumeDropsEvent,
    /// A request rejected with 400 still writes state (the sandbox record is stored first).
    RejectedRequestWritesState,
    /// Another principal's object is answered 403 instead of 404 (an existence leak).
    ForeignObject403,
    /// Another principal's sandboxes are visible in lists and by ID.
    ForeignObjectVisible,
    /// Kill answers 204 but leaves the sandbox and its processes in place.
    KillReportsSuccessWithoutRemoving,
    /// Retained process output never expires (no 410 after retention).
    OutputNeverExpires,
    /// Symlinks inside the sandbox root are followed out of it (string checks only).
    SymlinkEscape,
    /// Page tokens are not bound to their principal and filters.
    PageTokenUnbound,
    /// Preview URLs are proxied without checking the preview token.
    PreviewTokenUnchecked,
    /// `expires_at` passes and nothing happens.
    TtlNotEnforced,
    /// Pause answers 200 but the sandbox's processes keep running.
    PauseNoop,
    /// A sandbox created from a snapshot shares its files with the source.
    CloneSharesFiles,
    /// An idempotent replay creates a second resource.
    IdempotencyIgnored,
    /// Output written after the client disconnects is lost.
    OutputLostOnDisconnect,
    /// A submission whose worker died is queued again and re-run instead of becoming `uncertain`.
    WorkerDeathReplaysTurn,
    /// Deleting a session that borrowed its sandbox kills that sandbox.
    BorrowedSandboxKilledOnDelete,
    /// A sandbox whose create completes after its session was deleted is left running.
    LateCreateLeaks,
    /// Cancelling a finished submission turns it into `cancelled`.
    CancelFinishedChangesIt,
    /// Bridge writes under a stale lease generation are accepted.
    StaleLeaseWriteAccepted,
    /// A bridge request with an empty control revision is accepted.
    EmptyRevisionAccepted,
    /// Submission results stay readable after `retention.result_s`.
    ResultNeverExpires,
    /// A session's queued submissions start while an earlier one is still running.
    QueueRunsConcurrently,
    /// A resumed session event stream skips the first event after the cursor.
    SessionStreamDropsOnResume,
    /// Bridge requests are accepted without checking their signature.
    BridgeSignatureUnchecked,
    /// Deleting a session that owns its sandbox only detaches it, leaving it running.
    OwnedSandboxLeftOnDelete,
    /// Cancel of a running submission answers 202 but the turn keeps running.
    CancelRunningIgnored,
    /// Artifact content is read from the sandbox's file now, not the copy made at the turn's end.
    ArtifactTracksFile,
    /// Cancel of a running tool call answers 200 but the tool keeps running.
    OperationCancelIgnored,
    /// A submission's event stream ends like the session's stream: not after the submission's
    /// terminal event, and never 204.
    SubmissionStreamNeverEnds,
    /// A submission's event stream also carries the session's other events.
    SubmissionStreamLeaksOtherEvents,
    /// A lease nobody renews never expires: its turn stays `running` forever.
    LeaseNeverExpires,
    /// A new lease leaves the turn running under the old generation `running`.
    NewLeaseKeepsRunningTurn,
    /// `on_uncertain: continue` is ignored: the session pauses anyway.
    ContinuePausesAnyway,
    /// The per-principal stream quota is counted but never enforced.
    StreamQuotaUnenforced,
    /// A stream's slot is released only when the stream ends, not when the client closes it.
    StreamSlotLeakedOnClose,
    /// A submit beyond `limits.max_queue_depth` queued submissions is accepted.
    QueueLimitUnenforced,
    /// A submit to a session that is being deleted is accepted and queued.
    SubmitToDeletingAccepted,
    /// A cursor older than the retained log is answered from the oldest retained event
    /// instead of 410 `cursor_expired`.
    ExpiredCursorSkips,
    /// Each server process makes up its own page-token key instead of reading the one shared
    /// in the database: a page token from one process is refused by another.
    PageKeyPerProcess,
    /// Events other processes append are neither turned into wake-ups nor picked up by the
    /// streams' own polling: a stream sees only what its own process appends.
    ForeignAppendsIgnored,
    /// A worker that ended is taken to have finished its turn: the running submission
    /// becomes `completed`.
    WorkerExitCompletesTurn,
    /// An upload to a session being deleted is not refused as such.
    UploadToDeletingAccepted,
    /// `GET /v1/sessions?state=` ignores the filter and lists every session.
    SessionListIgnoresState,
    /// A stream's maximum duration is read as milliseconds: streams end almost at once with
    /// `stream.end {reason: max_duration}`.
    StreamEndsEarly,
    /// The heartbeat timer is armed once, for the opening heartbeat: an idle stream then goes
    /// silent until it ends.
    HeartbeatsStop,
    /// An open stream whose store read fails (the database is down) goes silent until its
    /// deadline, sending neither heartbeats nor an end, instead of ending at once.
    OutageStallsStream,
    /// `GET /v1/sandboxes/{id}/files/list` without credentials is answered for the sandbox's
    /// owner instead of 401.
    FileListSkipsAuth,
    /// `GET /v1/processes/{id}/output` without credentials is answered for the process's owner
    /// instead of 401.
    ProcessOutputSkipsAuth,
    /// The sandbox quota is counted before the create lock is taken: concurrent creates all see
    /// room and more than the quota succeed.
    QuotaCheckedOutsideLock,
    /// A process start the sandbox refuses (a `cwd` outside the root) answers 400 but keeps the
    /// process record it stored first.
    FailedStartLeavesProcess,
    /// A file write is staged as `<path>.upload` first; a write refused afterwards (onto a
    /// directory) leaves the staged file behind.
    RejectedWriteLeavesUpload,
    /// File reads (only reads) follow symlinks out of the sandbox root.
    ReadFollowsSymlinks,
    /// A path is cleaned like a URL path: `..` above the root and a leading `/` are dropped
    /// instead of refused.
    DotDotClampedAtRoot,
    /// An uploaded file's bytes are read as UTF-8 text: invalid sequences are stored as U+FFFD.
    UploadReadAsText,
    /// `eof: true` on stdin is answered 204 but the process's stdin stays open.
    StdinEofIgnored,
    /// An unknown signal name is sent as TERM instead of being refused with 400.
    SignalNameUnchecked,
    /// Output beyond the limit is dropped, but the output says `truncated: false`.
    TruncationUnreported,
    /// A server started again after a crash leaves the dead server's sandbox processes
    /// running, unowned, and their records `running`.
    RestartLeavesProcesses,
    /// While the store is unreachable, requests are answered 500 `internal` without
    /// `Retry-After` instead of 503 `unavailable`.
    StoreOutageIs500,
    /// A session whose home process died is never taken over by another process: its running
    /// turn stays `running` for ever.
    DeadHomeNeverTakenOver,
    // The E2B surface (crate::e2b).
    /// E2B control plane: another team's sandbox is answered 403 instead of 404.
    E2bForeignSandbox403,
    /// E2B `POST /sandboxes/{id}/timeout` only ever extends the sandbox's end, never shortens it.
    E2bTimeoutOnlyExtends,
    /// E2B connect to a paused sandbox answers 201 but leaves it paused.
    E2bConnectDoesNotResume,
    /// envd `Connect` to a process that has already ended ends the stream without its `end`.
    E2bLateConnectLosesExit,
    /// envd `POST /files` takes uploads as text: bytes that are not UTF-8 are altered.
    E2bFileBytesAltered,
    /// envd does not check `X-Access-Token` on secure sandboxes.
    E2bAccessTokenUnchecked,
    /// envd `CloseStdin` answers but the process's stdin stays open.
    E2bCloseStdinIgnored,
    /// envd `SendSignal` delivers SIGKILL as SIGTERM, which a process can ignore.
    E2bSigkillSentAsSigterm,
    /// envd `Connect` by `tag` finds no process (by pid still works).
    E2bConnectByTagNotFound,
    /// envd watchers report files created and removed but never written.
    E2bWatchMissesWrites,
    /// E2B `autoPause: true` is accepted, but expiry kills the sandbox instead of pausing it.
    E2bAutoPauseIgnored,
    /// envd processes do not get the `envVars` the sandbox was created with.
    E2bEnvVarsDropped,
    /// E2B control plane: a request without an API key is taken as the first team's.
    E2bMissingKeyAccepted,
    /// E2B `GET /sandboxes` and `GET /v2/sandboxes` list every team's sandboxes.
    E2bListShowsOtherTeams,
    /// E2B `GET /v2/sandboxes` ignores `nextToken`: every page is the first.
    E2bNextTokenIgnored,
    /// E2B `GET /v2/sandboxes` ignores `order=asc`: always newest first.
    E2bListOrderIgnored,
    /// E2B: a sandbox created from a snapshot starts with empty files.
    E2bSnapshotWithoutFiles,
    /// E2B `POST /sandboxes/{id}/fork` makes one fork whatever `count` asks.
    E2bForkCountIgnored,
    /// envd `EntryInfo.mode` carries the file-type bits (`0o100644`) beside the permissions.
    E2bModeWithTypeBits,
    /// envd `Remove` of a path that is not there is `not_found` instead of done.
    E2bRemoveMissingNotFound,
    /// envd `POST /files` stores a gzip-encoded upload without decoding it.
    E2bGzipUploadStoredCompressed,
    /// envd `POST /files` ignores `X-Metadata-*` headers.
    E2bMetadataDropped,
    /// E2B `GET /sandboxes/{id}/metrics` always answers no sample.
    E2bMetricsEmpty,
    /// E2B `POST /v2/sandboxes` is missing (405), as on platforms with only v1 routes.
    E2bV2CreateMissing,
    /// envd `Update` answers but leaves a PTY process's terminal at its old size.
    E2bPtyResizeIgnored,
    /// envd `Start` of a process that exits before writing anything ends the stream without its `end`.
    E2bFastExitLosesEnd,
    /// envd `POST /files` refuses `multipart/form-data` (415), taking only octet-stream bodies.
    E2bMultipartUploadRefused,
    /// envd `Start` ignores `Connect-Timeout-Ms`: the stream and its process run on past it.
    E2bRequestTimeoutIgnored,
    /// envd `Start` ends its stream at `Connect-Timeout-Ms` but leaves the process running.
    E2bTimeoutLeavesProcess,
    /// E2B `DELETE /sandboxes/{id}` answers 204 but leaves the sandbox running.
    E2bKillKeepsSandbox,
    /// envd process streams ignore `Keepalive-Ping-Interval`: a quiet stream carries nothing.
    E2bKeepaliveIgnored,
    /// envd `StreamInput` writes the first `data` message's input and drops the rest.
    E2bStreamInputDropsData,
    /// E2B's proxy serves only envd's port: every other sandbox port is 502.
    E2bPortProxyMissing,
    /// envd takes a signed file URL whose `signature_expiration` has passed.
    E2bSignatureExpiryIgnored,
    /// The code interpreter runs each execution in a fresh kernel: nothing is kept between them.
    E2bCiStateLost,
    /// The code interpreter runs every context's code in the default context's kernel.
    E2bCiContextsShareState,
    /// The code interpreter reports an exception as text on stderr, not as an error.
    E2bCiErrorAsStderr,
    /// The code interpreter's kernels do not get the sandbox's `envVars`.
    E2bCiEnvVarsDropped,
    /// The code interpreter leaves an execution running when its client goes away.
    E2bCiDisconnectNotInterrupted,
    // The reference MCP server (crate::mcp).
    /// `sandspec mcp` kills every sandbox it knows at shutdown, the borrowed ones too.
    McpKillsBorrowedAtShutdown,
    /// `sandspec mcp` leaves the sandboxes it created running at shutdown.
    McpKeepsCreatedAtShutdown,
    /// `sandspec mcp` returns bare sandbox IDs as handles, without their provider.
    McpBareHandles,
    /// `sandspec mcp` keeps a sandbox whose granted resources are below what was asked.
    McpUnverifiedResources,
    /// `sandspec mcp` leaves running the sandbox of a create still in flight when the session
    /// ended.
    McpLateCreateLeaks,
    /// `sandspec mcp` runs a command in another sandbox the session created, not the one the
    /// call names.
    McpRunsElsewhere,
    /// `sandspec mcp` leaves running the sandbox it made for a command that named none.
    McpRunLeavesSandbox,
    /// The host's whole filesystem is mounted read-only at `/host` inside every sandbox.
    SandboxSeesHostFiles,
    /// Sandboxes share the host's `/tmp`, writable, instead of a private one each.
    SandboxSharesHostTmp,
    /// Sandboxes have no PID namespace: the host's processes are listed in their `/proc`.
    SandboxSeesHostProcesses,
    /// Sandbox processes are not moved into the memory cgroup whose limit is read back.
    SandboxMemoryUnenforced,
}

impl Defect {
    /// Every defect, in a stable order.
    pub const ALL: &'static [Defect] = &[
        Defect::BorrowerCloseKillsOwner,
        Defect::BareIdAnyProvider,
        Defect::KillIgnoresProvider,
        Defect::UndersizedGrant,
        Defect::UnsatisfiableLeaks,
        Defect::SseResumeDropsEvent,
        Defect::RejectedRequestWritesState,
        Defect::ForeignObject403,
        Defect::ForeignObjectVisible,
        Defect::KillReportsSuccessWithoutRemoving,
        Defect::OutputNeverExpires,
        Defect::SymlinkEscape,
        Defect::PageTokenUnbound,
        Defect::PreviewTokenUnchecked,
        Defect::TtlNotEnforced,
        Defect::PauseNoop,
        Defect::CloneSharesFiles,
        Defect::IdempotencyIgnored,
        Defect::OutputLostOnDisconnect,
        Defect::WorkerDeathReplaysTurn,
        Defect::BorrowedSandboxKilledOnDelete,
        Defect::LateCreateLeaks,
        Defect::CancelFinishedChangesIt,
        Defect::StaleLeaseWriteAccepted,
        Defect::EmptyRevisionAccepted,
        Defect::ResultNeverExpires,
        Defect::QueueRunsConcurrently,
        Defect::SessionStreamDropsOnResume,
        Defect::BridgeSignatureUnchecked,
        Defect::OwnedSandboxLeftOnDelete,
        Defect::CancelRunningIgnored,
        Defect::ArtifactTracksFile,
        Defect::OperationCancelIgnored,
        Defect::SubmissionStreamNeverEnds,
        Defect::SubmissionStreamLeaksOtherEvents,
        Defect::LeaseNeverExpires,
        Defect::NewLeaseKeepsRunningTurn,
        Defect::ContinuePausesAnyway,
        Defect::StreamQuotaUnenforced,
        Defect::StreamSlotLeakedOnClose,
        Defect::QueueLimitUnenforced,
        Defect::SubmitToDeletingAccepted,
        Defect::ExpiredCursorSkips,
        Defect::PageKeyPerProcess,
        Defect::ForeignAppendsIgnored,
        Defect::WorkerExitCompletesTurn,
        Defect::UploadToDeletingAccepted,
        Defect::SessionListIgnoresState,
        Defect::StreamEndsEarly,
        Defect::HeartbeatsStop,
        Defect::OutageStallsStream,
        Defect::FileListSkipsAuth,
        Defect::ProcessOutputSkipsAuth,
        Defect::QuotaCheckedOutsideLock,
        Defect::FailedStartLeavesProcess,
        Defect::RejectedWriteLeavesUpload,
        Defect::ReadFollowsSymlinks,
        Defect::DotDotClampedAtRoot,
        Defect::UploadReadAsText,
        Defect::StdinEofIgnored,
        Defect::SignalNameUnchecked,
        Defect::TruncationUnreported,
        Defect::RestartLeavesProcesses,
        Defect::StoreOutageIs500,
        Defect::DeadHomeNeverTakenOver,
        Defect::E2bForeignSandbox403,
        Defect::E2bTimeoutOnlyExtends,
        Defect::E2bConnectDoesNotResume,
        Defect::E2bLateConnectLosesExit,
        Defect::E2bFileBytesAltered,
        Defect::E2bAccessTokenUnchecked,
        Defect::E2bCloseStdinIgnored,
        Defect::E2bSigkillSentAsSigterm,
        Defect::E2bConnectByTagNotFound,
        Defect::E2bWatchMissesWrites,
        Defect::E2bAutoPauseIgnored,
        Defect::E2bEnvVarsDropped,
        Defect::E2bMissingKeyAccepted,
        Defect::E2bListShowsOtherTeams,
        Defect::E2bNextTokenIgnored,
        Defect::E2bListOrderIgnored,
        Defect::E2bSnapshotWithoutFiles,
        Defect::E2bForkCountIgnored,
        Defect::E2bModeWithTypeBits,
        Defect::E2bRemoveMissingNotFound,
        Defect::E2bGzipUploadStoredCompressed,
        Defect::E2bMetadataDropped,
        Defect::E2bMetricsEmpty,
        Defect::E2bV2CreateMissing,
        Defect::E2bPtyResizeIgnored,
        Defect::E2bFastExitLosesEnd,
        Defect::E2bMultipartUploadRefused,
        Defect::E2bRequestTimeoutIgnored,
        Defect::E2bTimeoutLeavesProcess,
        Defect::E2bKillKeepsSandbox,
        Defect::E2bKeepaliveIgnored,
        Defect::E2bStreamInputDropsData,
        Defect::E2bPortProxyMissing,
        Defect::E2bSignatureExpiryIgnored,
        Defect::E2bCiStateLost,
        Defect::E2bCiContextsShareState,
        Defect::E2bCiErrorAsStderr,
        Defect::E2bCiEnvVarsDropped,
        Defect::E2bCiDisconnectNotInterrupted,
        Defect::McpKillsBorrowedAtShutdown,
        Defect::McpKeepsCreatedAtShutdown,
        Defect::McpBareHandles,
        Defect::McpUnverifiedResources,
        Defect::McpLateCreateLeaks,
        Defect::McpRunsElsewhere,
        Defect::McpRunLeavesSandbox,
        Defect::SandboxSeesHostFiles,
        Defect::SandboxSharesHostTmp,
        Defect::SandboxSeesHostProcesses,
        Defect::SandboxMemoryUnenforced,
    ];

    /// The stable kebab-case name used on the command line and in scenario files.
    pub fn name(self) -> &'static str {
        match self {
            Defect::BorrowerCloseKillsOwner => "borrower-close-kills-owner",
            Defect::BareIdAnyProvider => "bare-id-any-provider",
            Defect::KillIgnoresProvider => "kill-ignores-provider",
            Defect::UndersizedGrant => "undersized-grant",
            Defect::UnsatisfiableLeaks => "unsatisfiable-leaks",
            Defect::SseResumeDropsEvent => "sse-resume-drops-event",
            Defect::RejectedRequestWritesState => "rejected-request-writes-state",
            Defect::ForeignObject403 => "foreign-object-403",
            Defect::ForeignObjectVisible => "foreign-object-visible",
            Defect::KillReportsSuccessWithoutRemoving => "kill-reports-success-without-removing",
            Defect::OutputNeverExpires => "output-never-expires",
            Defect::SymlinkEscape => "symlink-escape",
            Defect::PageTokenUnbound => "page-token-unbound",
            Defect::PreviewTokenUnchecked => "preview-token-unchecked",
            Defect::TtlNotEnforced => "ttl-not-enforced",
            Defect::PauseNoop => "pause-noop",
            Defect::CloneSharesFiles => "clone-shares-files",
            Defect::IdempotencyIgnored => "idempotency-ignored",
            Defect::OutputLostOnDisconnect => "output-lost-on-disconnect",
            Defect::WorkerDeathReplaysTurn => "worker-death-replays-turn",
            Defect::BorrowedSandboxKilledOnDelete => "borrowed-sandbox-killed-on-delete",
            Defect::LateCreateLeaks => "late-create-leaks",
            Defect::CancelFinishedChangesIt => "cancel-finished-changes-it",
            Defect::StaleLeaseWriteAccepted => "stale-lease-write-accepted",
            Defect::EmptyRevisionAccepted => "empty-revision-accepted",
            Defect::ResultNeverExpires => "result-never-expires",
            Defect::QueueRunsConcurrently => "queue-runs-concurrently",
            Defect::SessionStreamDropsOnResume => "session-stream-drops-on-resume",
            Defect::BridgeSignatureUnchecked => "bridge-signature-unchecked",
            Defect::OwnedSandboxLeftOnDelete => "owned-sandbox-left-on-delete",
            Defect::CancelRunningIgnored => "cancel-running-ignored",
            Defect::ArtifactTracksFile => "artifact-tracks-file",
            Defect::OperationCancelIgnored => "operation-cancel-ignored",
            Defect::SubmissionStreamNeverEnds => "submission-stream-never-ends",
            Defect::SubmissionStreamLeaksOtherEvents => "submission-stream-leaks-other-events",
            Defect::LeaseNeverExpires => "lease-never-expires",
            Defect::NewLeaseKeepsRunningTurn => "new-lease-keeps-running-turn",
            Defect::ContinuePausesAnyway => "continue-pauses-anyway",
            Defect::StreamQuotaUnenforced => "stream-quota-unenforced",
            Defect::StreamSlotLeakedOnClose => "stream-slot-leaked-on-close",
            Defect::QueueLimitUnenforced => "queue-limit-unenforced",
            Defect::SubmitToDeletingAccepted => "submit-to-deleting-accepted",
            Defect::ExpiredCursorSkips => "expired-cursor-skips",
            Defect::PageKeyPerProcess => "page-key-per-process",
            Defect::ForeignAppendsIgnored => "foreign-appends-ignored",
            Defect::WorkerExitCompletesTurn => "worker-exit-completes-turn",
            Defect::UploadToDeletingAccepted => "upload-to-deleting-accepted",
            Defect::SessionListIgnoresState => "session-list-ignores-state",
            Defect::StreamEndsEarly => "stream-ends-early",
            Defect::HeartbeatsStop => "heartbeats-stop",
            Defect::OutageStallsStream => "outage-stalls-stream",
            Defect::FileListSkipsAuth => "file-list-skips-auth",
            Defect::ProcessOutputSkipsAuth => "process-output-skips-auth",
            Defect::QuotaCheckedOutsideLock => "quota-checked-outside-lock",
            Defect::FailedStartLeavesProcess => "failed-start-leaves-process",
            Defect::RejectedWriteLeavesUpload => "rejected-write-leaves-upload",
            Defect::ReadFollowsSymlinks => "read-follows-symlinks",
            Defect::DotDotClampedAtRoot => "dotdot-clamped-at-root",
            Defect::UploadReadAsText => "upload-read-as-text",
            Defect::StdinEofIgnored => "stdin-eof-ignored",
            Defect::SignalNameUnchecked => "signal-name-unchecked",
            Defect::TruncationUnreported => "truncation-unreported",
            Defect::RestartLeavesProcesses => "restart-leaves-processes",
            Defect::StoreOutageIs500 => "store-outage-is-500",
            Defect::DeadHomeNeverTakenOver => "dead-home-never-taken-over",
            Defect::E2bForeignSandbox403 => "e2b-foreign-sandbox-403",
            Defect::E2bTimeoutOnlyExtends => "e2b-timeout-only-extends",
            Defect::E2bConnectDoesNotResume => "e2b-connect-does-not-resume",
            Defect::E2bLateConnectLosesExit => "e2b-late-connect-loses-exit",
            Defect::E2bFileBytesAltered => "e2b-file-bytes-altered",
            Defect::E2bAccessTokenUnchecked => "e2b-access-token-unchecked",
            Defect::E2bCloseStdinIgnored => "e2b-close-stdin-ignored",
            Defect::E2bSigkillSentAsSigterm => "e2b-sigkill-sent-as-sigterm",
            Defect::E2bConnectByTagNotFound => "e2b-connect-by-tag-not-found",
            Defect::E2bWatchMissesWrites => "e2b-watch-misses-writes",
            Defect::E2bAutoPauseIgnored => "e2b-auto-pause-ignored",
            Defect::E2bEnvVarsDropped => "e2b-env-vars-dropped",
            Defect::E2bMissingKeyAccepted => "e2b-missing-key-accepted",
            Defect::E2bListShowsOtherTeams => "e2b-list-shows-other-teams",
            Defect::E2bNextTokenIgnored => "e2b-next-token-ignored",
            Defect::E2bListOrderIgnored => "e2b-list-order-ignored",
            Defect::E2bSnapshotWithoutFiles => "e2b-snapshot-without-files",
            Defect::E2bForkCountIgnored => "e2b-fork-count-ignored",
            Defect::E2bModeWithTypeBits => "e2b-mode-with-type-bits",
            Defect::E2bRemoveMissingNotFound => "e2b-remove-missing-not-found",
            Defect::E2bGzipUploadStoredCompressed => "e2b-gzip-upload-stored-compressed",
            Defect::E2bMetadataDropped => "e2b-metadata-dropped",
            Defect::E2bMetricsEmpty => "e2b-metrics-empty",
            Defect::E2bV2CreateMissing => "e2b-v2-create-missing",
            Defect::E2bPtyResizeIgnored => "e2b-pty-resize-ignored",
            Defect::E2bFastExitLosesEnd => "e2b-fast-exit-loses-end",
            Defect::E2bMultipartUploadRefused => "e2b-multipart-upload-refused",
            Defect::E2bRequestTimeoutIgnored => "e2b-request-timeout-ignored",
            Defect::E2bTimeoutLeavesProcess => "e2b-timeout-leaves-process",
            Defect::E2bKillKeepsSandbox => "e2b-kill-keeps-sandbox",
            Defect::E2bKeepaliveIgnored => "e2b-keepalive-ignored",
            Defect::E2bStreamInputDropsData => "e2b-stream-input-drops-data",
            Defect::E2bPortProxyMissing => "e2b-port-proxy-missing",
            Defect::E2bSignatureExpiryIgnored => "e2b-signature-expiry-ignored",
            Defect::E2bCiStateLost => "e2b-ci-state-lost",
            Defect::E2bCiContextsShareState => "e2b-ci-contexts-share-state",
            Defect::E2bCiErrorAsStderr => "e2b-ci-error-as-stderr",
            Defect::E2bCiEnvVarsDropped => "e2b-ci-env-vars-dropped",
            Defect::E2bCiDisconnectNotInterrupted => "e2b-ci-disconnect-not-interrupted",
            Defect::McpKillsBorrowedAtShutdown => "mcp-kills-borrowed-at-shutdown",
            Defect::McpKeepsCreatedAtShutdown => "mcp-keeps-created-at-shutdown",
            Defect::McpBareHandles => "mcp-bare-handles",
            Defect::McpUnverifiedResources => "mcp-unverified-resources",
            Defect::McpLateCreateLeaks => "mcp-late-create-leaks",
            Defect::McpRunsElsewhere => "mcp-runs-elsewhere",
            Defect::McpRunLeavesSandbox => "mcp-run-leaves-sandbox",
            Defect::SandboxSeesHostFiles => "sandbox-sees-host-files",
            Defect::SandboxSharesHostTmp => "sandbox-shares-host-tmp",
            Defect::SandboxSeesHostProcesses => "sandbox-sees-host-processes",
            Defect::SandboxMemoryUnenforced => "sandbox-memory-unenforced",
        }
    }

    /// One line saying what the bug does, for `sandspec serve --list-defects`.
    pub fn describe(self) -> &'static str {
        match self {
            Defect::BorrowerCloseKillsOwner => {
                "closing a borrowed connection kills the owner's sandbox"
            }
            Defect::BareIdAnyProvider => "bare IDs are looked up in every provider",
            Defect::KillIgnoresProvider => "kill ignores the provider of a qualified ID",
            Defect::UndersizedGrant => "resources are granted smaller than asked",
            Defect::UnsatisfiableLeaks => {
                "an unsatisfiable create answers 422 but leaves a sandbox behind"
            }
            Defect::SseResumeDropsEvent => {
                "a resumed SSE stream skips the first event after the cursor"
            }
            Defect::RejectedRequestWritesState => "a request rejected with 400 still writes state",
            Defect::ForeignObject403 => "another principal's object is answered 403 instead of 404",
            Defect::ForeignObjectVisible => "another principal's sandboxes are visible",
            Defect::KillReportsSuccessWithoutRemoving => "kill answers 204 but removes nothing",
            Defect::OutputNeverExpires => "retained process output never expires",
            Defect::SymlinkEscape => "symlinks are followed out of the sandbox root",
            Defect::PageTokenUnbound => "page tokens are not bound to their principal",
            Defect::PreviewTokenUnchecked => "preview URLs are proxied without a token check",
            Defect::TtlNotEnforced => "expired sandboxes are neither killed nor paused",
            Defect::PauseNoop => "pause leaves processes running",
            Defect::CloneSharesFiles => "a clone shares its files with the source sandbox",
            Defect::IdempotencyIgnored => "an idempotent replay creates a second resource",
            Defect::OutputLostOnDisconnect => "output produced after the client goes away is lost",
            Defect::WorkerDeathReplaysTurn => "a turn whose worker died is run again",
            Defect::BorrowedSandboxKilledOnDelete => "a session delete kills its borrowed sandbox",
            Defect::LateCreateLeaks => "a sandbox created after its session's delete is left",
            Defect::CancelFinishedChangesIt => "cancelling a finished submission changes its state",
            Defect::StaleLeaseWriteAccepted => "bridge writes under a stale lease are accepted",
            Defect::EmptyRevisionAccepted => "an empty bridge control revision is accepted",
            Defect::ResultNeverExpires => "submission results never expire",
            Defect::QueueRunsConcurrently => "queued submissions of one session run concurrently",
            Defect::SessionStreamDropsOnResume => "a resumed session stream skips an event",
            Defect::BridgeSignatureUnchecked => "bridge signatures are not checked",
            Defect::OwnedSandboxLeftOnDelete => "a session delete leaves its own sandbox running",
            Defect::CancelRunningIgnored => "a running turn's cancel is answered but not done",
            Defect::ArtifactTracksFile => "artifact content follows later changes to its file",
            Defect::OperationCancelIgnored => "a tool call's cancel is answered but not done",
            Defect::SubmissionStreamNeverEnds => {
                "a submission stream does not end after the submission does"
            }
            Defect::SubmissionStreamLeaksOtherEvents => {
                "a submission stream carries other submissions' events"
            }
            Defect::LeaseNeverExpires => "a lease that is not renewed never expires",
            Defect::NewLeaseKeepsRunningTurn => {
                "a new lease leaves the old generation's turn running"
            }
            Defect::ContinuePausesAnyway => "on_uncertain: continue pauses the session anyway",
            Defect::StreamQuotaUnenforced => "the per-principal stream quota is not enforced",
            Defect::StreamSlotLeakedOnClose => "a stream closed by its client keeps its slot",
            Defect::QueueLimitUnenforced => "submits beyond the queue depth are accepted",
            Defect::SubmitToDeletingAccepted => "a submit to a deleting session is accepted",
            Defect::ExpiredCursorSkips => {
                "an expired cursor resumes at the oldest retained event instead of 410"
            }
            Defect::PageKeyPerProcess => {
                "each server process signs page tokens with its own key, not the shared one"
            }
            Defect::ForeignAppendsIgnored => {
                "streams never see events that another server process appends"
            }
            Defect::WorkerExitCompletesTurn => {
                "a worker that ended is taken to have completed its turn"
            }
            Defect::UploadToDeletingAccepted => {
                "an upload to a deleting session is not refused as such"
            }
            Defect::SessionListIgnoresState => "the session list ignores its state filter",
            Defect::StreamEndsEarly => "streams end at once with stream.end {max_duration}",
            Defect::HeartbeatsStop => "an idle stream sends no heartbeat after its first",
            Defect::OutageStallsStream => "an open stream goes silent while the store is down",
            Defect::FileListSkipsAuth => "the file list route answers without credentials",
            Defect::ProcessOutputSkipsAuth => {
                "the process output route answers without credentials"
            }
            Defect::QuotaCheckedOutsideLock => {
                "the sandbox quota is checked outside its lock (a race)"
            }
            Defect::FailedStartLeavesProcess => "a refused process start leaves its process record",
            Defect::RejectedWriteLeavesUpload => "a refused file write leaves its staged upload",
            Defect::ReadFollowsSymlinks => "file reads follow symlinks out of the sandbox root",
            Defect::DotDotClampedAtRoot => "`..` above the root is dropped instead of refused",
            Defect::UploadReadAsText => "uploaded bytes are stored as lossy UTF-8 text",
            Defect::StdinEofIgnored => "stdin eof is answered but stdin stays open",
            Defect::SignalNameUnchecked => "an unknown signal name is sent as TERM",
            Defect::TruncationUnreported => "dropped output is not reported as truncated",
            Defect::RestartLeavesProcesses => {
                "after a crash, the dead server's sandbox processes run on, unowned"
            }
            Defect::StoreOutageIs500 => "an unreachable store is answered 500 without Retry-After",
            Defect::DeadHomeNeverTakenOver => "a dead home process's sessions are never taken over",
            Defect::E2bForeignSandbox403 => "E2B: another team's sandbox is answered 403, not 404",
            Defect::E2bTimeoutOnlyExtends => "E2B: a timeout call can extend but never shorten",
            Defect::E2bConnectDoesNotResume => {
                "E2B: connect to a paused sandbox does not resume it"
            }
            Defect::E2bLateConnectLosesExit => {
                "E2B: connecting to an ended process never delivers its end event"
            }
            Defect::E2bFileBytesAltered => "E2B: uploaded bytes that are not UTF-8 are altered",
            Defect::E2bAccessTokenUnchecked => "E2B: envd does not check the access token",
            Defect::E2bCloseStdinIgnored => "E2B: CloseStdin answers but stdin stays open",
            Defect::E2bSigkillSentAsSigterm => "E2B: SIGKILL is sent as SIGTERM",
            Defect::E2bConnectByTagNotFound => {
                "E2B: connecting to a process by its tag finds nothing"
            }
            Defect::E2bWatchMissesWrites => "E2B: watchers never report a write",
            Defect::E2bAutoPauseIgnored => {
                "E2B: autoPause is accepted but expiry kills the sandbox"
            }
            Defect::E2bEnvVarsDropped => "E2B: processes do not see the sandbox's envVars",
            Defect::E2bMissingKeyAccepted => {
                "E2B: a request without an API key acts as the first team"
            }
            Defect::E2bListShowsOtherTeams => "E2B: lists show other teams' sandboxes",
            Defect::E2bNextTokenIgnored => "E2B: the v2 list ignores nextToken",
            Defect::E2bListOrderIgnored => "E2B: the v2 list ignores order=asc",
            Defect::E2bSnapshotWithoutFiles => {
                "E2B: sandboxes from a snapshot start without its files"
            }
            Defect::E2bForkCountIgnored => "E2B: fork ignores count",
            Defect::E2bModeWithTypeBits => "E2B: entry modes carry file-type bits",
            Defect::E2bRemoveMissingNotFound => "E2B: removing a missing path is not_found",
            Defect::E2bGzipUploadStoredCompressed => "E2B: gzip uploads are stored compressed",
            Defect::E2bMetadataDropped => "E2B: upload metadata is dropped",
            Defect::E2bMetricsEmpty => "E2B: metrics are always empty",
            Defect::E2bV2CreateMissing => "E2B: POST /v2/sandboxes is missing",
            Defect::E2bPtyResizeIgnored => "E2B: Update leaves a terminal at its old size",
            Defect::E2bFastExitLosesEnd => "E2B: a command that fails at once gets no end event",
            Defect::E2bMultipartUploadRefused => "E2B: multipart uploads are refused",
            Defect::E2bRequestTimeoutIgnored => "E2B: a command's timeout is ignored",
            Defect::E2bTimeoutLeavesProcess => {
                "E2B: a command past its timeout loses its stream but keeps running"
            }
            Defect::E2bKillKeepsSandbox => "E2B: a kill answers 204 but the sandbox runs on",
            Defect::E2bKeepaliveIgnored => "E2B: process streams send no keepalive",
            Defect::E2bStreamInputDropsData => {
                "E2B: StreamInput keeps the first data message and drops the rest"
            }
            Defect::E2bPortProxyMissing => "E2B: only envd's port is reachable",
            Defect::E2bSignatureExpiryIgnored => "E2B: expired file URLs still work",
            Defect::E2bCiStateLost => "E2B code interpreter: nothing is kept between executions",
            Defect::E2bCiContextsShareState => {
                "E2B code interpreter: every context runs in the default context's kernel"
            }
            Defect::E2bCiErrorAsStderr => {
                "E2B code interpreter: an exception is reported as stderr text, not as an error"
            }
            Defect::E2bCiEnvVarsDropped => {
                "E2B code interpreter: kernels do not get the sandbox's envVars"
            }
            Defect::E2bCiDisconnectNotInterrupted => {
                "E2B code interpreter: an execution runs on after its client went away"
            }
            Defect::McpKillsBorrowedAtShutdown => {
                "MCP: shutdown kills the sandboxes the session only connected to"
            }
            Defect::McpKeepsCreatedAtShutdown => {
                "MCP: shutdown leaves the sandboxes the session created running"
            }
            Defect::McpBareHandles => "MCP: handles are bare IDs without their provider",
            Defect::McpUnverifiedResources => {
                "MCP: a sandbox granted less than the explicit requirement is kept"
            }
            Defect::McpLateCreateLeaks => {
                "MCP: a create still in flight when the session ends leaves its sandbox running"
            }
            Defect::McpRunsElsewhere => {
                "MCP: a command runs in another sandbox than the one the call names"
            }
            Defect::McpRunLeavesSandbox => {
                "MCP: a command that names no sandbox leaves the sandbox made for it running"
            }
            Defect::SandboxSeesHostFiles => "the host's files are visible inside sandboxes",
            Defect::SandboxSharesHostTmp => "sandboxes share the host's /tmp",
            Defect::SandboxSeesHostProcesses => "sandboxes see the host's processes",
            Defect::SandboxMemoryUnenforced => "sandbox processes escape the memory limit",
        }
    }
}

impl fmt::Display for Defect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
/// A name that is not one of the defects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownDefect(pub String);

impl fmt::Display for UnknownDefect {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "unknown defect `{}` (see `sandspec serve --list-defects`)",
            self.0
        )
    }
}

impl std::error::Error for UnknownDefect {}

impl FromStr for Defect {
    type Err = UnknownDefect;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Defect::ALL
            .iter()
            .copied()
            .find(|d| d.name() == s)
            .ok_or_else(|| UnknownDefect(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_are_unique() {
        let mut seen = std::collections::BTreeSet::new();
        for d in Defect::ALL {
            assert_eq!(d.name().parse::<Defect>().unwrap(), *d);
            assert!(seen.insert(d.name()), "duplicate name {}", d.name());
            assert!(!d.describe().is_empty(), "{} has no description", d.name());
        }
    }

    #[test]
    fn an_unknown_name_is_refused_with_where_to_look() {
        let e = "no-such-bug".parse::<Defect>().unwrap_err();
        assert_eq!(e, UnknownDefect("no-such-bug".into()));
        assert!(e.to_string().contains("--list-defects"), "{e}");
    }
}

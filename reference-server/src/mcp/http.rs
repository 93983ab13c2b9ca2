//! `sandspec mcp --listen`: the reference MCP server over MCP's streamable HTTP transport, at
//! `/mcp`, behind a bearer token. Each MCP session (its `Mcp-Session-Id`) has tools and
//! ownership of its own, and its end is the session's: a client's `DELETE`, or the session
//! expiring after it was idle too long. The `DELETE` is answered once what the session owned
//! has been disposed of, as the stdio server exits only then; a `DELETE` of a session that is
//! gone is 404, as for any other request naming it. Every event stream's events carry IDs, and
//! a session's client that lost a stream resumes it with `Last-Event-ID` (`replay`).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use futures_util::{Stream, StreamExt as _};
use rmcp::ErrorData;
#[expect(deprecated, reason = "see `SessionTools::set_level`")]
use rmcp::model::SetLevelRequestParams;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, ClientJsonRpcMessage, GetExtensions as _,
    InitializeRequestParams, InitializeResult, ListToolsResult, PaginatedRequestParams,
    ServerConfig, ServerJsonRpcMessage,
};
use rmcp::service::{RequestContext, RoleServer};
use rmcp::transport::streamable_http_server::session::local::{
    LocalSessionManager, LocalSessionManagerError, SessionConfig,
};
use rmcp::transport::streamable_http_server::session::{
    RestoreOutcome, ServerSseMessage, SessionId, SessionManager,
};
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use tokio_util::sync::CancellationToken;

use super::control::ControlPlane;
use super::replay::{Replay, Resumable};
use super::tools::SandboxTools;
use crate::config::constant_time_eq;
use crate::defects::Defects;

/// The path the MCP endpoint is served at.
pub const PATH: &str = "/mcp";

/// How `sandspec mcp --listen` serves.
pub struct HttpOptions {
    /// The bearer token every request must carry.
    pub token: String,
    /// How long a session may be idle before it expires and is disposed of.
    pub idle: Duration,
}

/// The sessions' tools by session ID, from their `initialize` to their end.
type Registry = Arc<Mutex<HashMap<SessionId, SandboxTools>>>;

fn lock(registry: &Registry) -> std::sync::MutexGuard<'_, HashMap<SessionId, SandboxTools>> {
    registry.lock().unwrap_or_else(|p| p.into_inner())
}

/// The session ID of an `initialize` request, put into its extensions by [`Sessions`], so
/// that the session's tools can say whose they are.
#[derive(Debug, Clone)]
struct SessionKey(SessionId);

/// rmcp's in-memory sessions, plus the disposal of what a session owns when it closes: on
/// `DELETE`, on expiry (rmcp closes a session whose worker ended, idle or not), and at server
/// shutdown.
struct Sessions {
    inner: LocalSessionManager,
    tools: Registry,
    /// The event log the sessions' streams resume from (also `inner`'s event store).
    replay: Arc<Replay>,
    /// Held for reading by each disposal in progress, so that a server that stops can wait
    /// for those that rmcp started (a session that expired, or whose stream ended).
    disposing: tokio::sync::RwLock<()>,
}

impl Sessions {
    /// Ends the session's ownership and waits until what it owned is disposed of: marked
    /// closed first, so that a create completing meanwhile kills its own sandbox.
    async fn dispose(tools: Option<SandboxTools>) {
        if let Some(tools) = tools {
            tools.end_session();
            tools.shutdown().await;
        }
    }

    /// Every session's end, for a server that stops: those still open, and those whose
    /// disposal is under way.
    async fn close_all(&self) {
        let all: Vec<SandboxTools> = lock(&self.tools).drain().map(|(_, t)| t).collect();
        for t in &all {
            t.end_session();
        }
        futures_util::future::join_all(all.into_iter().map(|t| Self::dispose(Some(t)))).await;
        let _all_done = self.disposing.write().await;
    }
}

impl SessionManager for Sessions {
    type Error = LocalSessionManagerError;
    type Transport = <LocalSessionManager as SessionManager>::Transport;

    async fn create_session(&self) -> Result<(SessionId, Self::Transport), Self::Error> {
        self.inner.create_session().await
    }

    async fn initialize_session(
        &self,
        id: &SessionId,
        mut message: ClientJsonRpcMessage,
    ) -> Result<ServerJsonRpcMessage, Self::Error> {
        if let ClientJsonRpcMessage::Request(request) = &mut message {
            request
                .request
                .extensions_mut()
                .insert(SessionKey(id.clone()));
        }
        self.inner.initialize_session(id, message).await
    }

    async fn has_session(&self, id: &SessionId) -> Result<bool, Self::Error> {
        self.inner.has_session(id).await
    }

    async fn close_session(&self, id: &SessionId) -> Result<(), Self::Error> {
        // Taken before the session leaves the registry, so that `close_all` cannot miss it.
        let _busy = self.disposing.read().await;
        let tools = lock(&self.tools).remove(id);
        if let Some(t) = &tools {
            t.end_session();
        }
        let closed = self.inner.close_session(id).await;
        self.replay.forget(id);
        Self::dispose(tools).await;
        closed
    }

    /// A request's stream, which belongs to the session from its first event on: only then
    /// can a client know an ID to resume it from.
    async fn create_stream(
        &self,
        id: &SessionId,
        message: ClientJsonRpcMessage,
    ) -> Result<impl Stream<Item = ServerSseMessage> + Send + Sync + 'static, Self::Error> {
        let stream = self.inner.create_stream(id, message).await?;
        let (replay, session) = (self.replay.clone(), id.clone());
        Ok(stream.inspect(move |event| {
            if let Some(event_id) = &event.event_id {
                replay.bind(event_id, &session);
            }
        }))
    }

    async fn accept_message(
        &self,
        id: &SessionId,
        message: ClientJsonRpcMessage,
    ) -> Result<(), Self::Error> {
        self.inner.accept_message(id, message).await
    }

    async fn create_standalone_stream(
        &self,
        id: &SessionId,
    ) -> Result<impl Stream<Item = ServerSseMessage> + Send + Sync + 'static, Self::Error> {
        self.inner.create_standalone_stream(id).await
    }

    /// The session's own stream from after `last_event_id`; the standalone stream afresh for
    /// an ID this server does not keep (the `0` of a standalone stream's first event); an
    /// error, which rmcp answers with an empty stream, for another session's stream.
    async fn resume(
        &self,
        id: &SessionId,
        last_event_id: String,
    ) -> Result<impl Stream<Item = ServerSseMessage> + Send + Sync + 'static, Self::Error> {
        match self.replay.resumable(&last_event_id, id) {
            Resumable::Own => Ok(self.inner.resume(id, last_event_id).await?.left_stream()),
            Resumable::Unknown => Ok(self
                .inner
                .create_standalone_stream(id)
                .await?
                .right_stream()),
            Resumable::Foreign => Err(LocalSessionManagerError::SessionNotFound(id.clone())),
        }
    }

    async fn restore_session(
        &self,
        _id: SessionId,
    ) -> Result<RestoreOutcome<Self::Transport>, Self::Error> {
        // Sessions live in this process only: one that is gone stays gone (404).
        Ok(RestoreOutcome::NotSupported)
    }
}

/// One session's MCP server: the sandbox tools, which enter themselves in the registry under
/// their session's ID at `initialize`. Every request the tools answer is handed on to them.
#[derive(Clone)]
struct SessionTools {
    tools: SandboxTools,
    registry: Registry,
}

impl rmcp::ServerHandler for SessionTools {
    fn get_info(&self) -> ServerConfig {
        self.tools.get_info()
    }

    async fn initialize(
        &self,
        request: InitializeRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<InitializeResult, ErrorData> {
        if let Some(SessionKey(id)) = context.extensions.get::<SessionKey>() {
            lock(&self.registry).insert(id.clone(), self.tools.clone());
        }
        context.peer.set_peer_info(request.clone());
        self.negotiate_initialize(&request)
    }

    #[expect(
        deprecated,
        reason = "logging is deprecated from protocol 2026-07-28 on; the versions this server \
                  speaks have it"
    )]
    async fn set_level(
        &self,
        request: SetLevelRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<(), ErrorData> {
        self.tools.set_level(request, context).await
    }

    async fn list_tools(
        &self,
        request: Option<PaginatedRequestParams>,
        context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, ErrorData> {
        self.tools.list_tools(request, context).await
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, ErrorData> {
        self.tools.call_tool(request, context).await
    }
}

/// Requests without `Authorization: Bearer <token>` get 401 and reach nothing else.
async fn require_token(State(token): State<Arc<str>>, request: Request, next: Next) -> Response {
    let given = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    if given.is_some_and(|t| constant_time_eq(t.as_bytes(), token.as_bytes())) {
        return next.run(request).await;
    }
    let mut response = (
        StatusCode::UNAUTHORIZED,
        [(header::CONTENT_TYPE, "application/json")],
        r#"{"error":"missing or wrong bearer token"}"#,
    )
        .into_response();
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static(r#"Bearer realm="sandspec-mcp""#),
    );
    response
}

/// A `DELETE` naming a session that is gone (it expired, or was deleted) is 404, as every
/// other request naming it is: the transport says so, and rmcp would answer it 202.
async fn gone_is_404(
    State(sessions): State<Arc<Sessions>>,
    request: Request,
    next: Next,
) -> Response {
    if request.method() == axum::http::Method::DELETE
        && let Some(id) = request
            .headers()
            .get("mcp-session-id")
            .and_then(|v| v.to_str().ok())
        && !sessions
            .inner
            .has_session(&SessionId::from(id))
            .await
            .unwrap_or(false)
    {
        return (StatusCode::NOT_FOUND, "Not Found: Session not found").into_response();
    }
    next.run(request).await
}

/// Serves MCP over streamable HTTP on `listener` until `stop` resolves, then ends every
/// session as its `DELETE` would, before the open event streams are closed and the server
/// returns.
pub async fn serve(
    listener: tokio::net::TcpListener,
    control: ControlPlane,
    defects: Defects,
    options: HttpOptions,
    stop: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let local: SocketAddr = listener.local_addr()?;
    let registry: Registry = Arc::default();
    let mut session_config = SessionConfig::default();
    session_config.keep_alive = Some(options.idle);
    let replay = Arc::new(Replay::default());
    let mut inner = LocalSessionManager::default().with_event_store(replay.clone());
    inner.session_config = session_config;
    let sessions = Arc::new(Sessions {
        inner,
        tools: registry.clone(),
        replay,
        disposing: tokio::sync::RwLock::new(()),
    });
    let cancel = CancellationToken::new();
    // The Host header must name this server: loopback names, and the address it listens on
    // (DNS rebinding: a browser's page cannot pass for it).
    let mut hosts = vec![
        "localhost".to_owned(),
        "127.0.0.1".to_owned(),
        "::1".to_owned(),
    ];
    if !local.ip().is_unspecified() && !local.ip().is_loopback() {
        hosts.push(local.ip().to_string());
    }
    let config = StreamableHttpServerConfig::default()
        .with_allowed_hosts(hosts)
        .with_cancellation_token(cancel.child_token());
    let service = StreamableHttpService::new(
        move || {
            Ok(SessionTools {
                tools: SandboxTools::new(control.clone(), defects.clone()),
                registry: registry.clone(),
            })
        },
        sessions.clone(),
        config,
    );
    let token: Arc<str> = options.token.into();
    // The token is checked first: without it nothing else is answered.
    let app = axum::Router::new()
        .route_service(PATH, service)
        .layer(axum::middleware::from_fn_with_state(
            sessions.clone(),
            gone_is_404,
        ))
        .layer(axum::middleware::from_fn_with_state(token, require_token));
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            stop.await;
            sessions.close_all().await;
            // Ends the sessions' event streams, which the graceful shutdown would wait for.
            cancel.cancel();
        })
        .await
}

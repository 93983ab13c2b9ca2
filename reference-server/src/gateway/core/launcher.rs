//! The worker launcher: starts a session's worker inside its sandbox (the command, its
//! environment, the bridge and model endpoints it is given), checks whether it lives, and
//! kills it.

use super::*;

impl Gateway {
    /// The model endpoint given to workers.
    pub async fn model_base_url(&self) -> ApiResult<String> {
        let url = self
            .model_url
            .get_or_try_init(|| async {
                if let Some(url) = &self.cfg.model_base_url {
                    return Ok::<_, ApiError>(url.clone());
                }
                let server =
                    crate::model_fixture::FixtureServer::start(self.cfg.fixtures_dir.clone())
                        .await
                        .map_err(|e| ApiError::internal(format!("fixture model server: {e}")))?;
                let url = server.base_url();
                *lock(&self.fixture) = Some(server);
                Ok(url)
            })
            .await?;
        Ok(url.clone())
    }

    /// The worker's command line: the configured binary; else `sandspec-worker` beside the
    /// running executable; else the running executable's `worker` subcommand.
    pub(super) fn worker_command(&self) -> ApiResult<Vec<String>> {
        let bin = self
            .cfg
            .worker_binary()
            .ok_or_else(|| ApiError::internal("the running executable is unknown"))?;
        let mut cmd = vec![bin.to_string_lossy().into_owned()];
        if self.cfg.worker_bin.is_none() && bin.file_name().is_none_or(|n| n != "sandspec-worker") {
            cmd.push("worker".into());
        }
        Ok(cmd)
    }

    pub(super) fn bridge_url(&self) -> String {
        let mut addr = self.state.local_addr;
        if addr.ip().is_unspecified() {
            addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        format!("{}://{addr}", self.state.scheme())
    }

    /// The server's own loopback addresses a worker needs (the bridge, the model endpoint),
    /// made reachable inside the sandbox's network namespace.
    pub(super) async fn forward_for_worker(
        &self,
        provider: &crate::sandbox::LocalProvider,
        local: &str,
        model_url: &str,
    ) -> ApiResult<()> {
        let mut addrs = vec![self.state.local_addr];
        if addrs[0].ip().is_unspecified() {
            addrs[0].set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        if let Ok(url) = reqwest::Url::parse(model_url)
            && let Some(host) = url.host_str()
            && let Some(port) = url.port_or_known_default()
            && let Ok(ip) = host.trim_matches(['[', ']']).parse::<std::net::IpAddr>()
        {
            addrs.push(std::net::SocketAddr::new(ip, port));
        }
        for addr in addrs {
            provider.forward_loopback(local, addr).await.map_err(|e| {
                ApiError::internal(format!("forwarding {addr} into the sandbox: {e}"))
            })?;
        }
        Ok(())
    }

    /// Starts a worker process inside the session's (running) sandbox.
    pub(super) async fn start_worker(
        &self,
        loaded: &Loaded,
        sandbox: &Record,
        rt: &SessionRt,
    ) -> ApiResult<()> {
        let (provider, local) = self.provider(&sandbox.id)?;
        let model_url = self.model_base_url().await?;
        self.forward_for_worker(&provider, &local, &model_url)
            .await?;
        let process_local = provider.allocate_local_id(IdKind::Process);
        let process_id = QualifiedId::new(provider.name(), &process_local).to_string();
        let cmd = self.worker_command()?;
        let mut env = BTreeMap::new();
        env.insert("SANDSPEC_BRIDGE_URL".to_owned(), self.bridge_url());
        if let Some(tls) = &self.state.config.tls {
            // The worker trusts the server's own certificate for the bridge.
            env.insert(
                "SANDSPEC_BRIDGE_CA_FILE".to_owned(),
                tls.cert.to_string_lossy().into_owned(),
            );
        }
        env.insert("SANDSPEC_SESSION_ID".to_owned(), loaded.doc.id.clone());
        env.insert(
            "SANDSPEC_CONTROL_REVISION".to_owned(),
            loaded.doc.control_revision.clone(),
        );
        env.insert("SANDSPEC_WORKER_ID".to_owned(), process_id.clone());
        env.insert("SANDSPEC_MODEL_BASE_URL".to_owned(), model_url);
        if let Some(model) = &self.cfg.model_override {
            env.insert("SANDSPEC_MODEL".to_owned(), model.clone());
        }
        if let Some(key) = &self.cfg.model_api_key {
            env.insert("SANDSPEC_MODEL_API_KEY".to_owned(), key.clone());
        }
        env.insert(
            "SANDSPEC_HEARTBEAT_MS".to_owned(),
            self.cfg.heartbeat_interval.as_millis().to_string(),
        );
        env.insert(
            "SANDSPEC_MAX_STEPS".to_owned(),
            self.cfg.max_steps.to_string(),
        );
        env.insert(
            "SANDSPEC_MAX_TOOL_OUTPUT_BYTES".to_owned(),
            self.cfg.max_tool_output_bytes.to_string(),
        );
        let spec = ProcessSpec {
            cmd,
            cwd: None,
            env,
            // The bridge secret goes through stdin, not the environment, so that it does not
            // sit in `/proc/<pid>/environ` for the tools' processes to read.
            stdin: true,
            timeout_ms: None,
            tag: Some("sandspec-worker".into()),
        };
        let process = Process::running(
            process_id.clone(),
            sandbox.id.clone(),
            spec.cmd.clone(),
            spec.tag.clone(),
            now(),
        );
        let rec = process_record(&process, loaded.rec.owner.clone(), encode(&process)?);
        self.state.store.insert(&rec).await?;
        let sandbox_env: BTreeMap<String, String> = sandbox
            .body
            .get("env")
            .and_then(|v| serde_json::from_value(v.clone()).ok())
            .unwrap_or_default();
        if let Err(e) = provider
            .spawn(&local, rec.clone(), &spec, &sandbox_env)
            .await
        {
            let _ = self.state.store.delete(Kind::Process, &rec.id).await;
            return Err(ApiError::internal(format!("starting the worker: {e}")));
        }
        let secret = format!("{}\n", loaded.doc.bridge_secret);
        if let Err(e) = provider
            .write_stdin(&process_id, secret.as_bytes(), true)
            .await
        {
            tracing::warn!(error = %e, "could not hand the worker its secret");
        }
        let mut live = rt.live();
        live.worker = Some(process_id);
        // The worker must take its lease within one TTL.
        live.lease_expires = None;
        Ok(())
    }

    /// Whether the worker process `process_id` is still running.
    pub(super) async fn worker_alive(&self, process_id: &str) -> ApiResult<bool> {
        Ok(self
            .state
            .store
            .get(Kind::Process, Scope::System, process_id)
            .await?
            .is_some_and(|r| r.state == "running"))
    }

    /// SIGKILLs the worker's process group and waits until its exit is recorded.
    pub async fn kill_worker(&self, process_id: &str) -> ApiResult<()> {
        let (provider, _) = self.provider(process_id)?;
        match provider.signal(process_id, Signal::Kill) {
            Ok(())
            | Err(
                crate::sandbox::ProviderError::ProcessExited
                | crate::sandbox::ProviderError::NotFound,
            ) => {}
            Err(e) => return Err(ApiError::internal(format!("killing the worker: {e}"))),
        }
        let deadline = Instant::now() + KILL_WAIT;
        while Instant::now() < deadline {
            if !self.worker_alive(process_id).await? {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Err(ApiError::internal("the worker did not exit after SIGKILL"))
    }

    // ----- supervision -----
}

//! The delete and cleanup state machine: a deleted session's running work is ended, its
//! owned sandbox killed (a borrowed one left alone), its log kept for a grace period and then
//! removed; and a sandbox whose create completes after its session was deleted is disposed of.

use super::*;

impl Gateway {
    /// Deleting: end the worker, dispose of (owned) or detach from (borrowed) the sandbox,
    /// and remove the session only once the sandbox's absence is confirmed.
    pub(super) async fn drive_cleanup(&self, loaded: &mut Loaded, rt: &SessionRt) -> ApiResult<()> {
        let worker = rt.take_worker();
        if let Some(pid) = worker {
            self.kill_worker(&pid).await?;
        }
        let sandbox_id = loaded.doc.sandbox_id.clone();
        let owned = loaded.doc.sandbox_ownership == "owned";
        let mut cleanup = loaded.doc.cleanup.clone().unwrap_or(Cleanup {
            sandbox: "pending".into(),
            attempts: 0,
            last_error: None,
        });
        let defects = &self.state.config.defects;
        let kill = if owned {
            !defects.has(Defect::OwnedSandboxLeftOnDelete)
        } else {
            defects.has(Defect::BorrowedSandboxKilledOnDelete)
        };
        let done = if kill {
            if rt.creating() {
                // The create task disposes of exactly this sandbox when it completes.
                false
            } else {
                cleanup.attempts += 1;
                cleanup.sandbox = "disposing".into();
                let (provider, local) = self.provider(&sandbox_id)?;
                let attempt = match self
                    .state
                    .store
                    .get(Kind::Sandbox, Scope::System, &sandbox_id)
                    .await?
                {
                    Some(rec) => crate::api::destroy_sandbox(&self.state, &rec).await,
                    None => provider
                        .destroy(&local)
                        .await
                        .map_err(|e| ApiError::internal(e.to_string())),
                };
                cleanup.last_error = attempt.err().map(|e| e.to_string());
                let absent = self
                    .state
                    .store
                    .get(Kind::Sandbox, Scope::System, &sandbox_id)
                    .await?
                    .is_none()
                    && !provider.exists(&local);
                if absent {
                    cleanup.sandbox = "absent".into();
                }
                absent
            }
        } else {
            if let Some(conn) = &loaded.doc.connection_id {
                self.state.store.delete(Kind::Connection, conn).await?;
            }
            cleanup.sandbox = "detached".into();
            true
        };
        if loaded.doc.cleanup.as_ref() != Some(&cleanup) {
            loaded.doc.cleanup = Some(cleanup);
            self.save_session(loaded).await?;
        }
        if done {
            self.finish_delete(loaded).await?;
        }
        Ok(())
    }

    /// Removes the session and everything below it; its log ends with `session.deleted`.
    pub(super) async fn finish_delete(&self, loaded: &Loaded) -> ApiResult<()> {
        let sid = loaded.doc.id.clone();
        for kind in [Kind::Operation, Kind::Submission, Kind::Artifact] {
            let mut q = ListQuery::new(kind, Scope::System);
            q.parent = Some(&sid);
            for rec in self.state.store.list(&q).await? {
                self.state.store.delete(kind, &rec.id).await?;
                if kind == Kind::Artifact {
                    let path = crate::gateway::artifacts::content_path(
                        &self.state.config.data_dir,
                        &rec.id,
                    );
                    if let Err(e) = tokio::fs::remove_file(&path).await
                        && e.kind() != std::io::ErrorKind::NotFound
                    {
                        tracing::warn!(artifact = %rec.id, error = %e, "could not remove artifact content");
                    }
                }
            }
        }
        self.append(&sid, "session.deleted", json!({})).await?;
        self.state.store.delete(Kind::Session, &sid).await?;
        self.forget(&sid);
        let state = self.state.clone();
        tokio::spawn(async move {
            tokio::time::sleep(DELETED_LOG_GRACE).await;
            // An expiry like the others: it waits while the test control holds expiry.
            let _pass = loop {
                match state.expiry_hold.pass().await {
                    Some(pass) => break pass,
                    None => tokio::time::sleep(Duration::from_millis(250)).await,
                }
            };
            if let Err(e) = state.store.drop_stream(&session_stream(&sid)).await {
                tracing::warn!(error = %e, "could not drop a deleted session's log");
            }
        });
        Ok(())
    }

    /// Creates the owned sandbox in the background; if the session was deleted meanwhile,
    /// disposes of exactly that sandbox.
    pub fn spawn_create(
        self: &Arc<Self>,
        sid: String,
        sandbox: Record,
        requested: crate::domain::Resources,
        timeout_s: u64,
        from_snapshot: Option<String>,
    ) {
        let gw = Arc::clone(self);
        let rt = self.rt(&sid);
        rt.live().creating = true;
        tokio::spawn(async move {
            if let Err(e) = gw
                .complete_create(
                    &sid,
                    &rt,
                    sandbox,
                    requested,
                    timeout_s,
                    from_snapshot.as_deref(),
                )
                .await
            {
                tracing::warn!(session = %sid, error = %e, "owned sandbox create failed");
            }
            rt.live().creating = false;
        });
    }

    pub(super) async fn complete_create(
        &self,
        sid: &str,
        rt: &SessionRt,
        sandbox: Record,
        requested: crate::domain::Resources,
        timeout_s: u64,
        from_snapshot: Option<&str>,
    ) -> ApiResult<()> {
        let (provider, local) = self.provider(&sandbox.id)?;
        let created = provider.create(&local, &requested, from_snapshot).await;
        let _guard = self.lock(rt, sid).await?;
        rt.live().creating = false;
        let session = self.session(Scope::System, sid).await?;
        let gone = session.as_ref().is_none_or(|s| s.doc.state == "deleting");
        let granted = match created {
            Ok(g) => g,
            Err(e) => {
                self.state.store.delete(Kind::Sandbox, &sandbox.id).await?;
                return Err(ApiError::internal(format!("provider create: {e}")));
            }
        };
        let leak = self.state.config.defects.has(Defect::LateCreateLeaks);
        if gone && !leak {
            provider
                .destroy(&local)
                .await
                .map_err(|e| ApiError::internal(e.to_string()))?;
            self.state.store.delete(Kind::Sandbox, &sandbox.id).await?;
            return Ok(());
        }
        let current = self
            .state
            .store
            .get(Kind::Sandbox, Scope::System, &sandbox.id)
            .await?;
        let mut rec = match current {
            Some(rec) => rec,
            None => {
                // Killed through §3 while starting.
                provider
                    .destroy(&local)
                    .await
                    .map_err(|e| ApiError::internal(e.to_string()))?;
                return Ok(());
            }
        };
        let mut sbx: Sandbox = decode(&rec)?;
        let started = now();
        sbx.state = SandboxState::Running;
        sbx.resources = granted;
        sbx.expires_at =
            started + time::Duration::seconds(i64::try_from(timeout_s).unwrap_or(i64::MAX / 4));
        let mut body = encode(&sbx)?;
        if let (Value::Object(new), Value::Object(old)) = (&mut body, &rec.body) {
            for key in ["env", "timeout_s"] {
                if let Some(v) = old.get(key) {
                    new.insert(key.into(), v.clone());
                }
            }
        }
        rec.body = body;
        rec.state = SandboxState::Running.as_str().to_owned();
        rec.due_at = Some(sbx.expires_at);
        match self.state.store.update(&rec).await {
            Ok(_) if gone && leak => match session {
                // The bug: the late completion ends the pending delete as if the sandbox
                // were already dealt with, and leaves it running.
                Some(loaded) => self.finish_delete(&loaded).await,
                None => Ok(()),
            },
            Ok(_) => Ok(()),
            Err(StoreError::NotFound) => {
                provider
                    .destroy(&local)
                    .await
                    .map_err(|e| ApiError::internal(e.to_string()))?;
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }
}

//! The supervisor: one loop that looks at every session each `supervise_interval` (and at
//! once when another process appends to one), expiring leases into `uncertain` turns, starting
//! workers for queued work, and purging results and events past their retention.

use super::*;

impl Gateway {
    /// Runs until shutdown: looks at every session each `supervise_interval`.
    /// A change made by another server process (a submit, a cancel, a delete appends to the
    /// session's log) also wakes the supervisor at once for that session.
    pub async fn supervise_forever(self: Arc<Self>) {
        let shutdown = self.state.shutdown.clone();
        let mut last_purge = Instant::now();
        let mut foreign = self.state.store.foreign_appends();
        let mut next_scan = Instant::now() + self.cfg.supervise_interval;
        // The test clock moving (TC-9.12) starts a pass with retention at once.
        let mut moved = crate::clock::subscribe();
        loop {
            let mut clock_moved = false;
            let appended = async {
                match foreign.as_mut() {
                    Some(rx) => rx.recv().await.ok(),
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep_until(next_scan) => {}
                Ok(()) = moved.changed() => clock_moved = true,
                Some((stream, _)) = appended => {
                    if let Some(sid) = stream.strip_prefix("session:")
                        && let Err(e) = self.supervise(sid).await
                    {
                        tracing::warn!(session = %sid, error = %e, "supervisor pass failed");
                    }
                    continue;
                }
            }
            next_scan = Instant::now() + self.cfg.supervise_interval;
            let sessions = match self
                .state
                .store
                .list(&ListQuery::new(Kind::Session, Scope::System))
                .await
            {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "supervisor: listing sessions failed");
                    continue;
                }
            };
            let purge = clock_moved || last_purge.elapsed() >= PURGE_EVERY;
            if purge {
                last_purge = Instant::now();
                // Retention waits while the test control holds expiry (TC-9.11).
                if let Some(_pass) = self.state.expiry_hold.pass().await
                    && let Err(e) = self.expire_results().await
                {
                    tracing::warn!(error = %e, "result retention failed");
                }
            }
            for rec in sessions {
                if let Err(e) = self.supervise(&rec.id).await {
                    tracing::warn!(session = %rec.id, error = %e, "supervisor pass failed");
                }
                if purge
                    && let Some(_pass) = self.state.expiry_hold.pass().await
                    && let Err(e) = self.purge_old_events(&rec.id).await
                {
                    tracing::warn!(session = %rec.id, error = %e, "event retention failed");
                }
            }
        }
    }

    /// Drops the output of results and the content of artifacts past their retention; their
    /// metadata stays (reads answer 410).
    pub(super) async fn expire_results(&self) -> ApiResult<()> {
        if self.state.config.defects.has(Defect::ResultNeverExpires) {
            return Ok(());
        }
        let store = &self.state.store;
        for mut rec in store.due(Kind::Submission, now(), 100).await? {
            let mut doc: SubmissionDoc = decode(&rec)?;
            doc.output = None;
            rec.body = encode(&doc)?;
            rec.due_at = None;
            match store.update(&rec).await {
                Ok(_) | Err(StoreError::Conflict | StoreError::NotFound) => {}
                Err(e) => return Err(e.into()),
            }
        }
        for mut rec in store.due(Kind::Artifact, now(), 100).await? {
            let path =
                crate::gateway::artifacts::content_path(&self.state.config.data_dir, &rec.id);
            if let Err(e) = tokio::fs::remove_file(&path).await
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(artifact = %rec.id, error = %e, "could not remove artifact content");
                continue;
            }
            rec.state = "expired".into();
            rec.due_at = None;
            match store.update(&rec).await {
                Ok(_) | Err(StoreError::Conflict | StoreError::NotFound) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    /// Drops the session's events older than `retention.events_s`; cursors before them are
    /// answered 410 `cursor_expired` from then on.
    pub(super) async fn purge_old_events(&self, sid: &str) -> ApiResult<()> {
        let stream = session_stream(sid);
        let store = &self.state.store;
        let cutoff = now()
            - time::Duration::seconds(
                i64::try_from(self.state.config.retention.events_s).unwrap_or(i64::MAX / 4),
            );
        let bounds = store.stream_bounds(&stream).await?;
        let mut through = bounds.purged_through;
        loop {
            let batch = store.events_after(&stream, through, 256).await?;
            let old: Vec<i64> = batch
                .iter()
                .take_while(|e| e.at < cutoff)
                .map(|e| e.seq)
                .collect();
            let Some(&last) = old.last() else { break };
            through = last;
            if old.len() < batch.len() || batch.len() < 256 {
                break;
            }
        }
        if through > bounds.purged_through {
            store.purge_events(&stream, through).await?;
        }
        Ok(())
    }

    /// One supervision pass over one session. Only the session's home process supervises it
    /// (it started the session's worker, whose bridge requests come to it); another process
    /// takes over once the home has been dead for the takeover grace.
    pub async fn supervise(&self, sid: &str) -> ApiResult<()> {
        let rt = self.rt(sid);
        let Some(seen) = self.session(Scope::System, sid).await? else {
            self.forget(sid);
            return Ok(());
        };
        if !self.is_home(&seen.doc).await? {
            // Another process took the session over: a worker this process still runs for it
            // is fenced already, and must not run on.
            if let Some(pid) = rt.take_worker() {
                tracing::warn!(session = %sid, "session taken over by another process; ending its worker here");
                self.kill_worker(&pid).await?;
            }
            return Ok(());
        }
        let _guard = self.lock(&rt, sid).await?;
        let Some(mut loaded) = self.session(Scope::System, sid).await? else {
            self.forget(sid);
            return Ok(());
        };
        if loaded.doc.home.as_deref() != Some(self.instance()) {
            if !self.is_home(&loaded.doc).await? {
                return Ok(());
            }
            tracing::info!(session = %sid, from = ?loaded.doc.home, "taking the session over");
            loaded.doc.home = Some(self.instance().to_owned());
            self.save_session(&mut loaded).await?;
        }
        // A worker that ended: its running submission's outcome is unknown.
        let worker = rt.worker();
        if let Some(pid) = &worker
            && !self.worker_alive(pid).await?
        {
            rt.live().worker = None;
            let running = self.active_submission(sid).await?;
            match running {
                Some((mut rec, mut sub))
                    if self
                        .state
                        .config
                        .defects
                        .has(Defect::WorkerExitCompletesTurn) =>
                {
                    // The bug: the worker's end is read as the turn's end.
                    self.end_running_operations(sid, &sub.id, "succeeded")
                        .await?;
                    self.end_submission(&mut rec, &mut sub, "completed", json!({}))
                        .await?;
                }
                Some((_, s))
                    if loaded
                        .doc
                        .lease_is_current(s.lease_generation.unwrap_or(-1)) =>
                {
                    self.make_uncertain(&mut loaded, "worker_lost").await?;
                }
                _ => {}
            }
            self.revoke_lease(&mut loaded, &rt).await?;
        }
        // A running turn that no worker here runs and no lease covers (this server process
        // restarted, and its workers with it): its outcome is unknown.
        let orphaned = rt.worker().is_none() && rt.live().lease_expires.is_none();
        if orphaned && !loaded.doc.lease_revoked && self.active_submission(sid).await?.is_some() {
            self.make_uncertain(&mut loaded, "worker_lost").await?;
            self.revoke_lease(&mut loaded, &rt).await?;
        }
        if loaded.doc.state == "deleting" {
            return self.drive_cleanup(&mut loaded, &rt).await;
        }
        // A lease not renewed in time (unless the test control holds expiry, TC-9.11).
        let pass = self.state.expiry_hold.pass().await;
        let expired = rt
            .live()
            .lease_expires
            .is_some_and(|t| crate::clock::instant() >= t)
            && !self.state.config.defects.has(Defect::LeaseNeverExpires)
            && pass.is_some();
        if expired && !loaded.doc.lease_revoked {
            if self.active_submission(sid).await?.is_some() {
                self.make_uncertain(&mut loaded, "lease_expired").await?;
            }
            self.revoke_lease(&mut loaded, &rt).await?;
            let worker = rt.take_worker();
            if let Some(pid) = worker {
                self.kill_worker(&pid).await?;
            }
        }
        drop(pass);
        // A cancel accepted by another server process: the grace starts when this one sees it.
        if rt.live().cancel_deadline.is_none()
            && let Some((_, sub)) = self.active_submission(sid).await?
            && sub.state == "cancelling"
        {
            rt.live().cancel_deadline = Some(Instant::now() + self.cfg.cancel_grace);
        }
        // A cancel the worker did not honour in time.
        let overdue = rt
            .live()
            .cancel_deadline
            .is_some_and(|t| Instant::now() >= t);
        if overdue {
            rt.live().cancel_deadline = None;
            if let Some((mut rec, mut sub)) = self.active_submission(sid).await?
                && sub.state == "cancelling"
            {
                let worker = rt.take_worker();
                if let Some(pid) = worker {
                    self.kill_worker(&pid).await?;
                }
                self.end_running_operations(sid, &sub.id, "cancelled")
                    .await?;
                self.end_submission(&mut rec, &mut sub, "cancelled", json!({}))
                    .await?;
                self.revoke_lease(&mut loaded, &rt).await?;
            }
        }
        // Queued work and no worker: start one.
        // A worker holding an unexpired lease is live even if this process did not start it.
        let leased = !loaded.doc.lease_revoked
            && rt
                .live()
                .lease_expires
                .is_some_and(|t| crate::clock::instant() < t);
        let idle = rt.worker().is_none() && !leased;
        let creating = rt.creating();
        if loaded.doc.state == "active"
            && idle
            && !self.submissions(sid, Some("queued")).await?.is_empty()
        {
            let sandbox = self
                .state
                .store
                .get(Kind::Sandbox, Scope::System, &loaded.doc.sandbox_id)
                .await?;
            match sandbox {
                Some(sbx) if sbx.state == "running" => {
                    let failed_starts = rt.live().starts_without_lease;
                    if failed_starts >= MAX_STARTS_WITHOUT_LEASE {
                        rt.live().starts_without_lease = 0;
                        self.fail_queued(
                            &loaded,
                            "worker_unavailable",
                            "the session's worker could not start",
                        )
                        .await?;
                    } else {
                        rt.live().starts_without_lease += 1;
                        if let Err(e) = self.start_worker(&loaded, &sbx, &rt).await {
                            tracing::warn!(session = %sid, error = %e, "could not start a worker");
                        }
                    }
                }
                Some(_) => {}
                None if !creating => {
                    self.fail_queued(
                        &loaded,
                        "sandbox_gone",
                        "the session's sandbox no longer exists",
                    )
                    .await?
                }
                None => {}
            }
        }
        Ok(())
    }

    /// The session cannot run work (its sandbox is gone, its worker cannot start): queued
    /// submissions fail instead of waiting forever.
    pub(super) async fn fail_queued(
        &self,
        loaded: &Loaded,
        code: &str,
        message: &str,
    ) -> ApiResult<()> {
        for (mut rec, mut sub) in self.submissions(&loaded.doc.id, Some("queued")).await? {
            let error = crate::gateway::model::ErrorBody {
                code: code.to_owned(),
                message: message.to_owned(),
            };
            sub.error = Some(error.clone());
            self.end_submission(&mut rec, &mut sub, "failed", json!({"error": error}))
                .await?;
        }
        Ok(())
    }
}

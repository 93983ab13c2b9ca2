//! What the API shows of a session and its submissions: views, queue positions, and the
//! artifacts a turn leaves (collected from the sandbox when it ends, served from the data
//! directory).

use super::*;

impl Gateway {
    pub async fn session_view(&self, loaded: &Loaded) -> ApiResult<Value> {
        let sid = &loaded.doc.id;
        let active = self.active_submission(sid).await?.map(|(_, d)| d.id);
        let depth = self.submissions(sid, Some("queued")).await?.len();
        let bounds = self.state.store.stream_bounds(&session_stream(sid)).await?;
        Ok(loaded.doc.view(active.as_deref(), depth, bounds.last_seq))
    }

    /// 1-based position among the session's queued submissions.
    pub async fn queue_position(&self, sub: &SubmissionDoc) -> ApiResult<Option<usize>> {
        if sub.state != "queued" {
            return Ok(None);
        }
        let queued = self.submissions(&sub.session_id, Some("queued")).await?;
        Ok(queued
            .iter()
            .position(|(_, d)| d.id == sub.id)
            .map(|i| i + 1))
    }

    pub async fn submission_view(&self, sub: &SubmissionDoc) -> ApiResult<Value> {
        Ok(sub.view(self.queue_position(sub).await?))
    }

    // ----- writing (callers hold the session lock) -----

    /// The session's sandbox files, if its sandbox still exists.
    pub(super) async fn sandbox_files(
        &self,
        sandbox_id: &str,
    ) -> Option<crate::sandbox::SandboxFiles> {
        let (provider, local) = self.provider(sandbox_id).ok()?;
        provider.files(&local).ok()
    }

    /// The `artifacts/` manifest of a sandbox now (empty when it cannot be read).
    pub async fn artifact_manifest(&self, sandbox_id: &str) -> crate::gateway::artifacts::Manifest {
        let Some(files) = self.sandbox_files(sandbox_id).await else {
            return Default::default();
        };
        tokio::task::spawn_blocking(move || crate::gateway::artifacts::scan(&files))
            .await
            .ok()
            .and_then(Result::ok)
            .map(|found| crate::gateway::artifacts::manifest(&found))
            .unwrap_or_default()
    }

    /// Copies the files below `artifacts/` that the submission created or changed, records
    /// them, and appends `artifact.created` for each (before the terminal event).
    pub(super) async fn collect_artifacts(&self, doc: &SubmissionDoc) -> ApiResult<()> {
        let Some(session) = self.session(Scope::System, &doc.session_id).await? else {
            return Ok(());
        };
        if session.doc.state == "deleting" {
            return Ok(());
        }
        let baseline = {
            let rt = self.rt(&doc.session_id);
            let mut live = rt.live();
            match live.artifact_baseline.take() {
                Some((id, manifest)) if id == doc.id => Some(manifest),
                _ => None,
            }
        };
        let Some(files) = self.sandbox_files(&session.doc.sandbox_id).await else {
            return Ok(());
        };
        let found = tokio::task::spawn_blocking(move || crate::gateway::artifacts::scan(&files))
            .await
            .map_err(ApiError::internal)?
            .map_err(|e| ApiError::internal(format!("scanning artifacts: {e}")))?;
        let dir = self.state.config.data_dir.join("artifacts");
        for file in crate::gateway::artifacts::changed(found, baseline.as_ref()) {
            let art = crate::gateway::artifacts::ArtifactDoc {
                id: crate::gateway::model::new_id("art_"),
                session_id: doc.session_id.clone(),
                submission_id: doc.id.clone(),
                path: file.path.clone(),
                size: file.bytes.len() as u64,
                sha256: file.sha256.clone(),
                created_at: now(),
                expires_at: doc
                    .result_expires_at
                    .unwrap_or_else(|| self.result_expiry()),
            };
            tokio::fs::create_dir_all(&dir)
                .await
                .map_err(ApiError::internal)?;
            tokio::fs::write(
                crate::gateway::artifacts::content_path(&self.state.config.data_dir, &art.id),
                &file.bytes,
            )
            .await
            .map_err(ApiError::internal)?;
            self.state
                .store
                .insert(&Record {
                    kind: Kind::Artifact,
                    id: art.id.clone(),
                    owner: session.rec.owner.clone(),
                    parent: Some(doc.session_id.clone()),
                    state: "available".into(),
                    body: encode(&art)?,
                    version: 1,
                    created_at: art.created_at,
                    due_at: Some(art.expires_at),
                })
                .await?;
            self.append(
                &doc.session_id,
                "artifact.created",
                json!({"submission_id": doc.id, "artifact_id": art.id, "path": art.path}),
            )
            .await?;
        }
        Ok(())
    }

    /// The artifacts of a submission, in creation order.
    pub async fn submission_artifacts(
        &self,
        sid: &str,
        sub_id: &str,
    ) -> ApiResult<Vec<crate::gateway::artifacts::ArtifactDoc>> {
        let mut q = ListQuery::new(Kind::Artifact, Scope::System);
        q.parent = Some(sid);
        let mut out = Vec::new();
        for rec in self.state.store.list(&q).await? {
            let art: crate::gateway::artifacts::ArtifactDoc = decode(&rec)?;
            if art.submission_id == sub_id {
                out.push(art);
            }
        }
        Ok(out)
    }
}

//! Lists: `limit`, opaque page tokens and the `{data, has_more, next_page_token}` shape.
//!
//! A page token carries the keyset cursor `(created_at, id)` of the last item sent, and an
//! HMAC-SHA256 over the cursor, the principal and the canonical filters, so a token cannot be
//! forged, used by another principal, or replayed with different filters.

use std::convert::Infallible;

use base64::Engine as _;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use hmac::{Hmac, Mac};
use serde::Serialize;
use sha2::Sha256;
use time::OffsetDateTime;

use crate::defects::Defect;
use crate::store::Record;

use super::error::ApiError;
use super::extract::QueryPairs;
use super::state::AppState;

/// What one list request asks for.
#[derive(Debug, Clone)]
pub struct PageRequest {
    pub limit: u32,
    /// Only records strictly after this keyset cursor.
    pub after: Option<(OffsetDateTime, String)>,
    principal: String,
    filters: String,
}

/// One page of a list response.
#[derive(Debug, Serialize)]
pub struct Page<T> {
    pub data: Vec<T>,
    pub has_more: bool,
    pub next_page_token: Option<String>,
}

impl PageRequest {
    /// Reads `limit` and `page_token` for `principal` listing with `filters` (a canonical
    /// string naming every filter of the request).
    pub fn parse(
        state: &AppState,
        query: &QueryPairs,
        principal: &str,
        filters: String,
    ) -> Result<Self, ApiError> {
        Self::from_parts(
            state,
            query.get("limit"),
            query.get("page_token"),
            principal,
            filters,
        )
    }

    /// [`PageRequest::parse`] from the raw `limit` and `page_token` values. Every list names
    /// its resource first in `filters`, so a token of one list is refused by another.
    pub fn from_parts(
        state: &AppState,
        limit: Option<&str>,
        page_token: Option<&str>,
        principal: &str,
        filters: String,
    ) -> Result<Self, ApiError> {
        let limits = &state.config.limits;
        let limit = match limit {
            None => limits.default_page_size,
            Some(raw) => match raw.parse::<u32>() {
                Ok(n) if (1..=limits.max_page_size).contains(&n) => n,
                _ => {
                    return Err(ApiError::invalid(
                        "limit",
                        format!("limit must be between 1 and {}", limits.max_page_size),
                    ));
                }
            },
        };
        let mut page = PageRequest {
            limit,
            after: None,
            principal: principal.to_owned(),
            filters,
        };
        if let Some(token) = page_token {
            page.after = Some(
                page.verify(state, token)
                    .ok_or(ApiError::InvalidPageToken)?,
            );
        }
        Ok(page)
    }

    fn mac(&self, state: &AppState, payload: &str) -> Hmac<Sha256> {
        let mut mac =
            Hmac::<Sha256>::new_from_slice(&state.page_key).expect("HMAC takes any key length");
        if !state.config.defects.has(Defect::PageTokenUnbound) {
            mac.update(self.principal.as_bytes());
            mac.update(b"\0");
            mac.update(self.filters.as_bytes());
            mac.update(b"\0");
        }
        mac.update(payload.as_bytes());
        mac
    }

    fn sign(&self, state: &AppState, last: &Record) -> String {
        let payload = format!("{}.{}", last.created_at.unix_timestamp_nanos(), last.id);
        let payload = URL_SAFE_NO_PAD.encode(payload);
        let tag = URL_SAFE_NO_PAD.encode(self.mac(state, &payload).finalize().into_bytes());
        format!("{payload}.{tag}")
    }

    fn verify(&self, state: &AppState, token: &str) -> Option<(OffsetDateTime, String)> {
        let (payload, tag) = token.split_once('.')?;
        let tag = URL_SAFE_NO_PAD.decode(tag).ok()?;
        self.mac(state, payload).verify_slice(&tag).ok()?;
        let decoded = String::from_utf8(URL_SAFE_NO_PAD.decode(payload).ok()?).ok()?;
        let (nanos, id) = decoded.split_once('.')?;
        let at = OffsetDateTime::from_unix_timestamp_nanos(nanos.parse().ok()?).ok()?;
        Some((at, id.to_owned()))
    }

    /// Builds the page from up to `limit + 1` matching records (the extra one only says that
    /// there is more).
    pub fn page<T, E>(
        &self,
        state: &AppState,
        mut records: Vec<Record>,
        view: impl FnMut(&Record) -> Result<T, E>,
    ) -> Result<Page<T>, E> {
        let has_more = records.len() > self.limit as usize;
        records.truncate(self.limit as usize);
        let next_page_token = if has_more {
            records.last().map(|r| self.sign(state, r))
        } else {
            None
        };
        let data = records.iter().map(view).collect::<Result<_, _>>()?;
        Ok(Page {
            data,
            has_more,
            next_page_token,
        })
    }

    /// [`PageRequest::page`] with views made beforehand, one per record in the same order (views
    /// that had to be awaited).
    pub fn page_of<T: Default>(
        &self,
        state: &AppState,
        records: Vec<Record>,
        views: Vec<T>,
    ) -> Page<T> {
        let mut views = views.into_iter();
        let Ok(page) = self.page(state, records, |_| {
            Ok::<_, Infallible>(views.next().unwrap_or_default())
        });
        page
    }
}

//! SSE responses over durable logs (§7).

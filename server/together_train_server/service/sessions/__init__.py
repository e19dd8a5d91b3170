"""Sessions: records (`record`), creation/lookup/stop/expiry (`manager`), client heartbeats (`heartbeats`)."""

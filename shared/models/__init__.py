"""Model fixtures Baton builds itself (nothing is downloaded)."""

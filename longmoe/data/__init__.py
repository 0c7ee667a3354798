"""Policy-update data: checks of single samples (validate), shared by every data source."""

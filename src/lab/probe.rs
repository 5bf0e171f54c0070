//! Placeholder (being written): `kube-proxy lab serve` and `kube-proxy lab probe`.

/// Arguments of `kube-proxy lab serve`.
#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {}

/// Arguments of `kube-proxy lab probe`.
#[derive(clap::Args, Debug, Clone)]
pub struct ProbeArgs {}

pub fn serve(_args: &ServeArgs) -> anyhow::Result<()> {
    anyhow::bail!("not built yet")
}

pub fn probe(_args: &ProbeArgs) -> anyhow::Result<()> {
    anyhow::bail!("not built yet")
}

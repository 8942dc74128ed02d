//! Database URLs: `sqlite://PATH` or `postgres://user@host:port/db`.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use super::Error;

/// Where the database is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DbUrl {
    /// A SQLite file. `sqlite://keel.db` is `./keel.db`; `sqlite:///var/lib/keel.db` is
    /// absolute: the path after `sqlite://` is taken literally.
    Sqlite(PathBuf),
    /// A PostgreSQL connection URL, passed to libpq as given.
    Postgres(String),
}

impl FromStr for DbUrl {
    type Err = Error;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(path) = s.strip_prefix("sqlite://") {
            if path.is_empty() {
                return Err(Error::BadUrl(s.to_owned()));
            }
            return Ok(Self::Sqlite(PathBuf::from(path)));
        }
        if s.starts_with("postgres://") || s.starts_with("postgresql://") {
            return Ok(Self::Postgres(s.to_owned()));
        }
        Err(Error::BadUrl(s.to_owned()))
    }
}

impl fmt::Display for DbUrl {
    /// The URL with any password replaced by `***`, fit for logs and error messages.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Sqlite(path) => write!(f, "sqlite://{}", path.display()),
            Self::Postgres(url) => f.write_str(&redact_password(url)),
        }
    }
}

fn redact_password(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let Some((userinfo, host)) = rest.split_once('@') else {
        return url.to_owned();
    };
    match userinfo.split_once(':') {
        Some((user, _password)) => format!("{scheme}://{user}:***@{host}"),
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sqlite_paths_are_taken_literally() {
        assert_eq!(
            "sqlite://keel.db".parse::<DbUrl>().unwrap(),
            DbUrl::Sqlite("keel.db".into())
        );
        assert_eq!(
            "sqlite:///var/lib/keel.db".parse::<DbUrl>().unwrap(),
            DbUrl::Sqlite("/var/lib/keel.db".into())
        );
    }

    #[test]
    fn postgres_urls_are_kept_and_their_passwords_hidden_when_shown() {
        let url: DbUrl = "postgres://keel:hunter2@db:5432/keel".parse().unwrap();
        assert_eq!(
            url,
            DbUrl::Postgres("postgres://keel:hunter2@db:5432/keel".into())
        );
        assert_eq!(url.to_string(), "postgres://keel:***@db:5432/keel");
        let plain: DbUrl = "postgresql://root@127.0.0.1/test".parse().unwrap();
        assert_eq!(plain.to_string(), "postgresql://root@127.0.0.1/test");
    }

    #[test]
    fn other_schemes_are_refused_with_the_accepted_forms() {
        for bad in ["keel.db", "mysql://x", "sqlite://", "sqlite:keel.db"] {
            let err = bad.parse::<DbUrl>().unwrap_err();
            assert!(err.to_string().contains("sqlite://PATH"), "{err}");
        }
    }
}

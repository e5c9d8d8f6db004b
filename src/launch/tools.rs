//! The subcommands that help set up authentication: `hash-password` (an argon2 hash for a
//! `[[users]]` entry) and `new-token` (a `[[tokens]]` entry, the token itself shown once).

use std::io::IsTerminal;
use std::process::ExitCode;

use crate::auth::{self, Role};
use crate::config::Command;

/// Runs a subcommand other than `serve`, to its exit code.
pub fn run(command: Command) -> ExitCode {
    match command {
        Command::Serve(_) => ExitCode::SUCCESS,
        Command::HashPassword => hash_password(),
        Command::NewToken { principal, role } => new_token(&principal, role.into()),
    }
}

fn hash_password() -> ExitCode {
    let mut line = String::new();
    if std::io::stdin().is_terminal() {
        eprintln!("password (echoed; pipe it in to avoid that):");
    }
    if let Err(error) = std::io::stdin().read_line(&mut line) {
        eprintln!("gpu-flight: cannot read the password: {error}");
        return ExitCode::from(2);
    }
    let Some(password) = password_of(&line) else {
        eprintln!("gpu-flight: the password is empty");
        return ExitCode::from(2);
    };
    match auth::hash_password(password) {
        Ok(hash) => {
            println!("{hash}");
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("gpu-flight: cannot hash the password: {error}");
            ExitCode::FAILURE
        }
    }
}

/// The password on a line read from standard input, without its line ending; `None` if empty.
fn password_of(line: &str) -> Option<&str> {
    Some(line.trim_end_matches(['\r', '\n'])).filter(|password| !password.is_empty())
}

fn new_token(principal: &str, role: Role) -> ExitCode {
    match auth::new_token() {
        Ok((token, digest)) => {
            println!("{}", token_entry(principal, role, &digest));
            eprintln!("bearer token for {principal:?} (shown once; the file keeps only its hash):");
            eprintln!("{token}");
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("gpu-flight: cannot make a token: {error}");
            ExitCode::FAILURE
        }
    }
}

/// The `[[tokens]]` entry for the token file.
fn token_entry(principal: &str, role: Role, digest: &str) -> String {
    format!("[[tokens]]\nprincipal = {principal:?}\nrole = \"{role}\"\nsha256 = \"{digest}\"")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_password_is_the_line_without_its_ending() {
        assert_eq!(password_of("s3cret\r\n"), Some("s3cret"));
        assert_eq!(password_of("with space \n"), Some("with space "));
        assert_eq!(password_of("\n"), None);
        assert_eq!(password_of(""), None);
    }

    #[test]
    fn a_token_entry_is_toml_the_token_file_reads() {
        let entry = token_entry("etl \"nightly\"", Role::Write, "ab12");
        assert_eq!(
            entry,
            "[[tokens]]\nprincipal = \"etl \\\"nightly\\\"\"\nrole = \"write\"\nsha256 = \"ab12\""
        );
        let parsed: toml::Table = entry.parse().expect("TOML");
        assert!(parsed.contains_key("tokens"), "{parsed:?}");
    }
}

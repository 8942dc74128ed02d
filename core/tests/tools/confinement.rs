//! Confinement: no tool reads, writes or lists outside the session directory.

use std::os::unix::fs::symlink;

use serde_json::json;

use super::support::*;

#[tokio::test]
async fn paths_that_leave_the_session_directory_are_refused_by_every_file_tool() {
    let s = Session::new();
    s.file("a/inside.txt", "inside\n");
    let secret = s.outside.join("secret.txt");
    let absolute = secret.to_str().expect("utf-8 path").to_owned();
    for path in [
        "../outside/secret.txt",
        "a/../../outside/secret.txt",
        "./../outside/secret.txt",
        absolute.as_str(),
    ] {
        let calls = [
            ("read", json!({ "path": path })),
            ("write", json!({ "path": path, "content": "x" })),
            ("edit", json!({ "path": path, "old": "secret", "new": "x" })),
            ("list", json!({ "path": path })),
            ("grep", json!({ "pattern": "needle", "path": path })),
        ];
        for (name, input) in calls {
            assert_eq!(s.call(name, input).await, escape(path), "{name} {path}");
        }
    }
    assert_eq!(s.call("list", json!({ "path": ".." })).await, escape(".."));
    assert_eq!(
        std::fs::read_to_string(&secret).expect("secret"),
        "secret needle\n"
    );
}

#[tokio::test]
async fn symlinks_leading_outside_are_refused_for_files_and_directories() {
    let s = Session::new();
    s.link("secret-link", s.outside.join("secret.txt"));
    s.link("dir-link", s.outside.join("dir"));
    s.link("relative-link", "../outside/secret.txt");
    s.link("dangling-link", s.outside.join("new.txt"));
    for path in [
        "secret-link",
        "relative-link",
        "dir-link",
        "dir-link/deep.txt",
        "dangling-link",
    ] {
        let calls = [
            ("read", json!({ "path": path })),
            ("write", json!({ "path": path, "content": "x" })),
            ("edit", json!({ "path": path, "old": "needle", "new": "x" })),
            ("list", json!({ "path": path })),
            ("grep", json!({ "pattern": "needle", "path": path })),
        ];
        for (name, input) in calls {
            assert_eq!(s.call(name, input).await, escape(path), "{name} {path}");
        }
    }
    assert!(!s.outside.join("new.txt").exists());
    assert_eq!(
        std::fs::read_to_string(s.outside.join("secret.txt")).expect("secret"),
        "secret needle\n"
    );
}

#[tokio::test]
async fn writing_through_a_symlinked_parent_directory_that_leads_outside_is_refused() {
    let s = Session::new();
    s.link("out", &s.outside);
    assert_eq!(
        s.call(
            "write",
            json!({ "path": "out/created/new.txt", "content": "x" })
        )
        .await,
        escape("out/created/new.txt")
    );
    assert!(!s.outside.join("created").exists());
}

#[tokio::test]
async fn a_symlink_inside_that_points_inside_is_followed() {
    let s = Session::new();
    s.file("real/file.txt", "hello\n");
    s.link("file-link", "real/file.txt");
    s.link("dir-link", s.root.join("real"));
    let read = s
        .call("read", json!({ "path": "file-link" }))
        .await
        .expect("read through link");
    assert_eq!(text(&read), "1: hello");
    s.call(
        "write",
        json!({ "path": "dir-link/new.txt", "content": "new" }),
    )
    .await
    .expect("write through link");
    assert_eq!(
        std::fs::read_to_string(s.root.join("real/new.txt")).expect("written"),
        "new"
    );
    let listed = s.call("list", json!({})).await.expect("list");
    assert_eq!(text(&listed), "dir-link/\nfile-link\nreal/");
}

#[tokio::test]
async fn absolute_paths_inside_the_session_directory_are_accepted() {
    let s = Session::new();
    s.file("notes.txt", "one\n");
    let absolute = s.root.join("notes.txt");
    let read = s
        .call(
            "read",
            json!({ "path": absolute.to_str().expect("utf-8 path") }),
        )
        .await
        .expect("read");
    assert_eq!(
        read.structured,
        json!({ "path": "notes.txt", "offset": 1, "lines": 1, "more": false, "truncated": false })
    );
}

#[tokio::test]
async fn glob_grep_and_list_do_not_report_files_outside_through_symlinks() {
    let s = Session::new();
    s.file("mine.txt", "my needle\n");
    s.link("secret-link.txt", s.outside.join("secret.txt"));
    s.link("dir-link", s.outside.join("dir"));
    s.link("dangling.txt", s.outside.join("missing.txt"));

    let listed = s.call("list", json!({})).await.expect("list");
    assert_eq!(text(&listed), "mine.txt");
    let globbed = s
        .call("glob", json!({ "pattern": "*.txt" }))
        .await
        .expect("glob");
    assert_eq!(text(&globbed), "mine.txt");
    let grepped = s
        .call("grep", json!({ "pattern": "needle" }))
        .await
        .expect("grep");
    assert_eq!(text(&grepped), "mine.txt:1: my needle");
}

/// A directory that flips between itself and a symlink leading outside while the file
/// tools run on paths through it: whatever moment each tool resolves and opens at,
/// nothing outside is read, listed, written or created.
#[tokio::test]
async fn a_directory_swapped_for_a_symlink_mid_call_never_leads_a_tool_outside() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    let s = Session::new();
    s.file("a/mine.txt", "mine needle\n");
    let outside_dir = s.outside.join("dir");
    let stop = Arc::new(AtomicBool::new(false));
    let flipper = {
        let stop = Arc::clone(&stop);
        let (dir, parked) = (s.root.join("a"), s.root.join("a.real"));
        let target = outside_dir.clone();
        std::thread::spawn(move || {
            let mut flips = 0u64;
            while !stop.load(Ordering::Relaxed) {
                std::fs::rename(&dir, &parked).expect("park the directory");
                // A `write` may create `a` anew while it is parked: clear it away.
                while symlink(&target, &dir).is_err() {
                    let _ = std::fs::remove_dir_all(&dir);
                }
                std::thread::sleep(std::time::Duration::from_micros(100));
                std::fs::remove_file(&dir).expect("remove the symlink");
                while std::fs::rename(&parked, &dir).is_err() {
                    let _ = std::fs::remove_dir_all(&dir);
                }
                std::thread::sleep(std::time::Duration::from_micros(100));
                flips += 1;
            }
            flips
        })
    };
    let mut succeeded = 0;
    for _ in 0..300 {
        if let Ok(out) = s.call("read", json!({ "path": "a/deep.txt" })).await {
            panic!("read reached outside: {}", text(&out));
        }
        let edited = s.call(
            "edit",
            json!({ "path": "a/deep.txt", "old": "needle", "new": "x" }),
        );
        assert!(edited.await.is_err(), "edit reached outside");
        if let Ok(out) = s.call("list", json!({ "path": "a" })).await {
            assert!(!text(&out).contains("deep.txt"), "list reached outside");
            succeeded += 1;
        }
        if let Ok(out) = s
            .call("grep", json!({ "pattern": "needle", "path": "a" }))
            .await
        {
            assert!(!text(&out).contains("deep"), "grep reached outside");
        }
        let _ = s
            .call("write", json!({ "path": "a/new/file.txt", "content": "x" }))
            .await;
    }
    stop.store(true, Ordering::Relaxed);
    let flips = flipper.join().expect("flipper");
    assert!(
        flips > 0 && succeeded > 0,
        "the race was run ({flips} flips, {succeeded} lists)"
    );
    let mut outside: Vec<_> = std::fs::read_dir(&outside_dir)
        .expect("outside")
        .map(|e| e.expect("entry").file_name())
        .collect();
    outside.sort();
    assert_eq!(outside, ["deep.txt"], "nothing was created outside");
    assert_eq!(
        std::fs::read_to_string(outside_dir.join("deep.txt")).expect("deep"),
        "deep needle\n"
    );
}

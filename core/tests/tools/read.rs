//! `read`: numbered lines, limits, images as media stored once, clear errors.

use base64::Engine as _;
use keel_core::tool::{Error, Limits, Output};
use keel_schema::types::ToolContent;
use serde_json::json;

use super::support::*;

#[tokio::test]
async fn read_numbers_lines_and_honours_offset_and_limit() {
    let s = Session::new();
    s.file("five.txt", "a\nb\nc\nd\ne\n");
    let all = s
        .call("read", json!({ "path": "five.txt" }))
        .await
        .expect("read");
    assert_eq!(text(&all), "1: a\n2: b\n3: c\n4: d\n5: e");
    let window = s
        .call(
            "read",
            json!({ "path": "five.txt", "offset": 2, "limit": 2 }),
        )
        .await
        .expect("read window");
    assert_eq!(
        window,
        Output {
            structured: json!({ "path": "five.txt", "offset": 2, "lines": 2, "more": true, "truncated": false }),
            content: vec![ToolContent::Text {
                text: "2: b\n3: c\n… more lines follow; continue with offset=4".into()
            }],
        }
    );
}

#[tokio::test]
async fn read_returns_at_most_max_lines_whatever_limit_is_asked() {
    let s = Session::with_limits(Limits {
        max_lines: 2,
        ..Limits::default()
    });
    s.file("five.txt", "a\nb\nc\nd\ne\n");
    let read = s
        .call("read", json!({ "path": "five.txt", "limit": 100 }))
        .await
        .expect("read");
    assert_eq!(
        text(&read),
        "1: a\n2: b\n… more lines follow; continue with offset=3"
    );
}

#[tokio::test]
async fn read_of_a_missing_file_is_not_found() {
    let s = Session::new();
    let err = s
        .call("read", json!({ "path": "nope.txt" }))
        .await
        .expect_err("missing");
    assert_eq!(err, Error::NotFound("nope.txt".into()));
    assert_eq!(err.info().kind, "tool.not-found");
}

#[tokio::test]
async fn read_of_a_directory_is_an_error_that_suggests_list() {
    let s = Session::new();
    s.file("src/main.rs", "fn main() {}\n");
    assert_eq!(
        s.call("read", json!({ "path": "src" })).await,
        Err(Error::Io(
            "`src` is a directory; use `list` to see its entries".into()
        ))
    );
}

#[tokio::test]
async fn read_of_a_binary_file_that_is_not_an_image_is_a_clear_error() {
    let s = Session::new();
    s.file("blob.bin", [0u8, 1, 2, 3, 0, 255]);
    let err = s
        .call("read", json!({ "path": "blob.bin" }))
        .await
        .expect_err("binary");
    assert_eq!(
        err,
        Error::Io(
            "`blob.bin` is a binary file (not text, and not a png, jpeg, gif or webp image); \
             use `bash` to inspect it"
                .into()
        )
    );
}

#[tokio::test]
async fn read_returns_an_image_once_as_media_and_never_in_structured_output() {
    let s = Session::new();
    s.file("pixel.dat", PIXEL_PNG);
    let read = s
        .call("read", json!({ "path": "pixel.dat" }))
        .await
        .expect("read image");
    let media: Vec<_> = read
        .content
        .iter()
        .filter_map(|c| match c {
            ToolContent::Media { mime, data } => Some((mime.clone(), data.clone())),
            ToolContent::Text { .. } => None,
        })
        .collect();
    assert_eq!(media.len(), 1, "exactly one media part");
    let (mime, data) = &media[0];
    assert_eq!(mime, "image/png");
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(data)
        .expect("valid base64");
    assert_eq!(decoded, PIXEL_PNG);
    assert_eq!(
        read.structured,
        json!({ "path": "pixel.dat", "mime": "image/png", "bytes": PIXEL_PNG.len() })
    );
    assert!(!read.structured.to_string().contains(data.as_str()));
    let texts: Vec<_> = read
        .content
        .iter()
        .filter_map(|c| match c {
            ToolContent::Text { text } => Some(text.as_str()),
            ToolContent::Media { .. } => None,
        })
        .collect();
    assert!(texts.iter().all(|t| !t.contains(data.as_str())));
}

#[tokio::test]
async fn read_detects_images_by_content_not_by_extension() {
    let s = Session::new();
    s.file("fake.png", "not an image\n");
    let read = s
        .call("read", json!({ "path": "fake.png" }))
        .await
        .expect("read text");
    assert_eq!(text(&read), "1: not an image");
}

//! Unit tests of `image_spec` (a file of their own: the module stays under 700 lines).
use super::*;

fn run(args: &[&str]) -> Result<Vec<String>, String> {
    let mut a: Vec<std::ffi::OsString> = args.iter().map(Into::into).collect();
    rewrite(&mut a, "qimg")?;
    Ok(a.into_iter().map(|s| s.into_string().unwrap()).collect())
}

#[test]
fn option_strings_and_json_become_file_names() {
    assert_eq!(
        run(&[
            "qimg",
            "info",
            "--image-opts",
            "driver=qcow2,file.filename=a,,b.qcow2,l2-cache-size=1M"
        ])
        .unwrap(),
        ["qimg", "info", "a,b.qcow2"]
    );
    assert_eq!(
        run(&[
            "qimg",
            "check",
            r#"json:{"driver":"qcow2","file":{"driver":"file","filename":"x.qcow2"}}"#
        ])
        .unwrap(),
        ["qimg", "check", "x.qcow2"]
    );
    assert_eq!(
        run(&[
            "qimg",
            "info",
            r#"json:{"driver":"file","filename":"r.raw"}"#
        ])
        .unwrap(),
        ["qimg", "info", "r.raw"]
    );
    // Without --image-opts an option-like name is a file name.
    assert_eq!(
        run(&["qimg", "info", "driver=qcow2,file.filename=a"]).unwrap(),
        ["qimg", "info", "driver=qcow2,file.filename=a"]
    );
    // Other arguments stay.
    assert_eq!(
        run(&[
            "qimg",
            "convert",
            "--image-opts",
            "-O",
            "raw",
            "driver=raw,file.filename=a",
            "b"
        ])
        .unwrap(),
        ["qimg", "convert", "-O", "raw", "a", "b"]
    );
}

#[test]
fn nbd_options_become_nbd_names() {
    let args = |spec: &str| run(&["qimg", "info", "--image-opts", spec]);
    assert_eq!(
        args("driver=nbd,server.type=unix,server.path=/r/s.sock,export=e").unwrap(),
        ["qimg", "info", "nbd+unix:///e?socket=/r/s.sock"]
    );
    assert_eq!(
        args("driver=raw,file.driver=nbd,file.host=h,file.port=99").unwrap(),
        ["qimg", "info", "nbd://h:99/"]
    );
    assert_eq!(
        run(&[
            "qimg",
            "info",
            r#"json:{"driver":"nbd","server":{"type":"inet","host":"::1","port":"7"},"export":"a&b"}"#
        ])
        .unwrap(),
        ["qimg", "info", "nbd://[::1]:7/a%26b"]
    );
    let e = args("driver=nbd,path=/s,tls-creds=nope").unwrap_err();
    assert!(e.ends_with(": No TLS credentials with id 'nope'"), "{e}");
    add_tls_creds("srv", "/d", false);
    let e = args("driver=nbd,path=/s,tls-creds=srv").unwrap_err();
    assert!(
        e.ends_with(": Expected TLS credentials for a client endpoint"),
        "{e}"
    );
    add_tls_creds("cli", "/d", true);
    let e = args("driver=nbd,path=/s,tls-creds=cli").unwrap_err();
    assert!(
        e.ends_with(": No hostname for certificate validation"),
        "{e}"
    );
    assert_eq!(
        args("driver=nbd,path=/s,tls-creds=cli,tls-hostname=x").unwrap(),
        [
            "qimg",
            "info",
            "nbds+unix:///?socket=/s&tls-certificates=/d&tls-hostname=x"
        ]
    );
    let e = args("driver=nbd,path=/s,bogus=1").unwrap_err();
    assert!(e.contains("'bogus'"), "{e}");
}

#[test]
fn bench_keeps_its_own_image_opts() {
    let args = [
        "qimg",
        "bench",
        "--image-opts",
        "driver=qcow2,file.filename=a,l2-cache-size=8k",
    ];
    assert_eq!(run(&args).unwrap(), args);
}

#[test]
fn what_is_not_supported_is_refused_naming_it() {
    let e = run(&[
        "qimg",
        "info",
        "--image-opts",
        "driver=qcow2,file.filename=a,bogus=1",
    ])
    .unwrap_err();
    assert!(e.contains("does not support the option 'bogus'"), "{e}");
    let e = run(&[
        "qimg",
        "info",
        r#"json:{"driver":"qcow2","file":{"driver":"ssh","host":"h"}}"#,
    ])
    .unwrap_err();
    assert!(e.contains("ssh"), "{e}");
    let e = run(&["qimg", "info", "json:{nope"]).unwrap_err();
    assert!(e.contains("JSON"), "{e}");
    let e = run(&[
        "qimg",
        "info",
        "--image-opts",
        "driver=vmdk,file.filename=a",
    ])
    .unwrap_err();
    assert!(e.contains("vmdk"), "{e}");
}

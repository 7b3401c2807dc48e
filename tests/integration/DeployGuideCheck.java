// What tests/integration/test_deploy_guide.py asks of pyspark's own jars about the
// YARN and Kubernetes sections of docs/deploy.md, in one JVM (run as a single source
// file: java -cp 'pyspark/jars/*' DeployGuideCheck.java MODE ...). Each mode prints
// lines "WORD\tA\tB" for the test to read; nothing here decides pass or fail.
//
//   keys KEY...   for each key: "entry\tKEY" when Spark defines it (a ConfigEntry of
//                 core, YARN or Kubernetes), else "unknown\tKEY"; then every prefix
//                 constant of those config objects: "prefix\tNAME\tVALUE".
//   yarn PROPS STAGING JOB
//                 the YARN client of spark-yarn given the Spark config in PROPS (what
//                 spark-submit made of the guide's command): the application master's
//                 environment ("env\tNAME\tVALUE", Client.setupLaunchEnv) and the
//                 files YARN localizes into its working directory ("local\tLINK\tTYPE",
//                 Client.prepareLocalResources, into STAGING on the local file system).
//   k8s-yaml FILE the manifests in FILE read into fabric8's typed Kubernetes model (the
//                 one Spark submits with): "kind\tKIND\tNAME" per object, and
//                 "unknown\tPATH\tFIELD" for every field that the model does not know
//                 (fabric8 keeps those in additionalProperties instead of failing).

import java.io.FileInputStream;
import java.lang.reflect.Method;
import java.lang.reflect.Modifier;
import java.nio.file.Files;
import java.nio.file.Path;
import java.util.ArrayList;
import java.util.Collection;
import java.util.List;
import java.util.Map;
import java.util.Properties;
import java.util.TreeMap;

public class DeployGuideCheck {
  static final String[] CONFIG_OBJECTS = {
    "org.apache.spark.internal.config.package$",
    "org.apache.spark.internal.config.Python$",
    "org.apache.spark.deploy.yarn.config.package$",
    "org.apache.spark.deploy.k8s.Config$",
  };

  public static void main(String[] args) throws Exception {
    switch (args[0]) {
      case "keys" -> keys(args);
      case "yarn" -> yarn(args[1], args[2], args[3]);
      case "k8s-yaml" -> k8sYaml(args[1]);
      default -> throw new IllegalArgumentException(args[0]);
    }
  }

  static void keys(String[] args) throws Exception {
    Map<String, String> prefixes = new TreeMap<>();
    for (String name : CONFIG_OBJECTS) {
      Class<?> cls = Class.forName(name); // initializing it registers its entries
      Object module = cls.getField("MODULE$").get(null);
      for (Method m : cls.getMethods()) {
        if (m.getParameterCount() == 0
            && m.getReturnType() == String.class
            && !Modifier.isStatic(m.getModifiers())) {
          Object value = m.invoke(module);
          if (value instanceof String s && s.startsWith("spark.") && s.endsWith(".")) {
            prefixes.put(m.getName(), s);
          }
        }
      }
    }
    for (int i = 1; i < args.length; i++) {
      boolean known =
          org.apache.spark.internal.config.ConfigEntry$.MODULE$.findEntry(args[i]) != null;
      System.out.println((known ? "entry" : "unknown") + "\t" + args[i]);
    }
    prefixes.forEach((n, v) -> System.out.println("prefix\t" + n + "\t" + v));
  }

  static void yarn(String props, String staging, String job) throws Exception {
    Properties p = new Properties();
    try (FileInputStream in = new FileInputStream(props)) {
      p.load(in);
    }
    org.apache.spark.SparkConf conf = new org.apache.spark.SparkConf(false);
    for (String k : p.stringPropertyNames()) {
      conf.set(k, p.getProperty(k));
    }
    var clientArgs =
        new org.apache.spark.deploy.yarn.ClientArguments(
            new String[] {"--primary-py-file", job, "--class", "org.apache.spark.deploy.PythonRunner"});
    var client = new org.apache.spark.deploy.yarn.Client(clientArgs, conf, null);
    var dir = new org.apache.hadoop.fs.Path(staging);
    @SuppressWarnings("unchecked")
    var nil = (scala.collection.immutable.Seq<String>) (Object) scala.collection.immutable.Nil$.MODULE$;
    var env = scala.jdk.javaapi.CollectionConverters.asJava(client.setupLaunchEnv(dir, nil));
    new TreeMap<>(env).forEach((k, v) -> System.out.println("env\t" + k + "\t" + v));
    var local =
        scala.jdk.javaapi.CollectionConverters.asJava(client.prepareLocalResources(dir, nil));
    new TreeMap<>(local)
        .forEach((k, v) -> System.out.println("local\t" + k + "\t" + v.getType()));
  }

  static void k8sYaml(String file) throws Exception {
    var serialization = new io.fabric8.kubernetes.client.utils.KubernetesSerialization();
    Object parsed = serialization.unmarshal(Files.readString(Path.of(file)));
    List<Object> items = new ArrayList<>();
    if (parsed instanceof Collection<?> c) {
      items.addAll(c);
    } else if (parsed instanceof io.fabric8.kubernetes.api.model.KubernetesList l) {
      items.addAll(l.getItems());
    } else {
      items.add(parsed);
    }
    for (Object item : items) {
      var meta = (io.fabric8.kubernetes.api.model.HasMetadata) item;
      System.out.println("kind\t" + meta.getKind() + "\t" + meta.getMetadata().getName());
      walk(item, meta.getKind());
    }
  }

  // Every getter of fabric8's model classes, down the tree; additionalProperties holds
  // what the model did not recognise.
  static void walk(Object o, String path) throws Exception {
    if (o == null) {
      return;
    }
    if (o instanceof Collection<?> c) {
      int i = 0;
      for (Object e : c) {
        walk(e, path + "[" + i++ + "]");
      }
      return;
    }
    if (o instanceof Map<?, ?> m) {
      for (var e : m.entrySet()) {
        walk(e.getValue(), path + "[" + e.getKey() + "]");
      }
      return;
    }
    if (!o.getClass().getName().startsWith("io.fabric8.kubernetes.api.model")) {
      return;
    }
    for (Method m : o.getClass().getMethods()) {
      if (m.getParameterCount() != 0 || !m.getName().startsWith("get")
          || m.getDeclaringClass() == Object.class) {
        continue;
      }
      Object value = m.invoke(o);
      if (m.getName().equals("getAdditionalProperties")) {
        for (Object key : ((Map<?, ?>) value).keySet()) {
          System.out.println("unknown\t" + path + "\t" + key);
        }
      } else {
        String field = m.getName().substring(3);
        walk(value, path + "." + Character.toLowerCase(field.charAt(0)) + field.substring(1));
      }
    }
  }
}
